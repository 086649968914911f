"""Pipeline policy and WAN link model: pure functions shared by the router and the simulator.

``choose_pipeline(RoutingInputs, RoutingPolicy) -> PipelineDecision`` picks P->MD, P->RLD->MD or
singular for one request; ``choose_handoff_mode(rld_load, policy)`` picks one-shot or catch-up at
handoff time; ``LinkEstimate.transfer_s`` / ``LinkModel`` estimate how long the missing KV takes on
the WAN. No I/O: callers pass what they observed, and ``now`` where time matters.
"""

from pddlink.handoff import HandoffMode  # the one handoff mode; routing decides which
from pddlink.routing.link import LinkEstimate, LinkModel
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
    "DecisionReason",
    "HandoffDecision",
    "HandoffMode",
    "LinkEstimate",
    "LinkModel",
    "Pipeline",
    "PipelineDecision",
    "RoutingInputs",
    "RoutingPolicy",
    "choose_handoff_mode",
    "choose_pipeline",
    "rld_finishes_first",
]
