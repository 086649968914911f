"""Token-id handoff from RelayDecode to MainDecode: the slice planner (RLD side), the intake check
(MD side) and the router's stream merger. Pure: no I/O, no clocks."""

from pddlink.handoff.merge import MergedToken, StreamMerger
from pddlink.handoff.plan import HandoffError, HandoffIntake, HandoffMode, HandoffPlan, HandoffSlice

__all__ = [
    "HandoffError",
    "HandoffIntake",
    "HandoffMode",
    "HandoffPlan",
    "HandoffSlice",
    "MergedToken",
    "StreamMerger",
]
