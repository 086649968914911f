"""Pipeline policy and WAN link model: pure functions shared by the router and the simulator.

``choose_pipeline(RoutingInputs, RoutingPolicy) -> PipelineDecision`` picks P->MD, P->RLD->MD or
singular for one request; ``choose_handoff_mode(rld_load, policy)`` picks one-shot or catch-up at
handoff time; ``LinkEstimate.transfer_s`` / ``LinkModel`` estimate how long the missing KV takes on
the WAN, with the bytes already queued to MD (``BacklogReport``); ``choose_option`` picks ship,
relay, recompute, relay + recompute or singular per request, or rejects it when none meets its
deadline; ``place`` picks the P, MD and RLD instances of one request over a fleet
(``pddlink.routing.placement``). No I/O: callers pass what they observed, and ``now`` where time
matters.
"""

from pddlink.handoff import HandoffMode  # the one handoff mode; routing decides which
from pddlink.routing.decode_bound import MdPrefill, MdRun
from pddlink.routing.link import BacklogReport, LinkEstimate, LinkModel
from pddlink.routing.options import (
    Option,
    OptionDecision,
    OptionEstimate,
    OptionInputs,
    RecomputeMode,
    RejectReason,
    allowed_options,
    choose_option,
    estimate_options,
    md_miss_label,
)
from pddlink.routing.placement import (
    FleetView,
    LinkView,
    MdSnapshot,
    Placement,
    PlacementConfig,
    PlacementMemory,
    PlacementPolicy,
    PlacementReason,
    PlacementRefusal,
    PlacementRequest,
    PSnapshot,
    RefusalReason,
    RldSnapshot,
    choose_rld,
    place,
)
from pddlink.routing.policy import (
    DecisionReason,
    HandoffDecision,
    Pipeline,
    PipelineDecision,
    RoutingInputs,
    RoutingPolicy,
    choose_handoff_mode,
    choose_pipeline,
    rld_finishes_first,
)

__all__ = [
    "BacklogReport",
    "DecisionReason",
    "FleetView",
    "HandoffDecision",
    "HandoffMode",
    "LinkEstimate",
    "LinkModel",
    "LinkView",
    "MdPrefill",
    "MdRun",
    "MdSnapshot",
    "Option",
    "OptionDecision",
    "OptionEstimate",
    "OptionInputs",
    "PSnapshot",
    "Pipeline",
    "PipelineDecision",
    "Placement",
    "PlacementConfig",
    "PlacementMemory",
    "PlacementPolicy",
    "PlacementReason",
    "PlacementRefusal",
    "PlacementRequest",
    "RecomputeMode",
    "RefusalReason",
    "RejectReason",
    "RldSnapshot",
    "RoutingInputs",
    "RoutingPolicy",
    "allowed_options",
    "choose_handoff_mode",
    "choose_option",
    "choose_pipeline",
    "choose_rld",
    "estimate_options",
    "md_miss_label",
    "place",
    "rld_finishes_first",
]
