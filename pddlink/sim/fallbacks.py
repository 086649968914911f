"""The simulator's fallbacks: what the router decides for each pipeline under each fault, taken
from the router's own machine (``pddlink.lifecycle.predict`` runs ``RequestRun``), not modelled a
second time. ``fallback_table()`` is the hook for the simulator's reports and scenarios.
"""

from __future__ import annotations

from typing import Any

from pddlink.lifecycle.predict import Faults, predict
from pddlink.routing import Pipeline

FAULTS: dict[str, Faults] = {
    "none": Faults(),
    "md_unreachable": Faults(md_reachable=False),  # the WAN shipment failed or outlived its deadline
    "md_unreachable_rld_down": Faults(md_reachable=False, rld_usable=False),
    "md_lost_mid_stream": Faults(md_lost_after=3),
    "rld_unreachable": Faults(rld_reachable=False),
    "rld_lost_mid_stream": Faults(rld_lost_after=1),
    "handoff_failed": Faults(handoff_ok=False),
}


def fallback_table(max_tokens: int = 16) -> dict[str, dict[str, dict[str, Any]]]:
    """pipeline -> fault -> {outcome, reason, fallbacks, tokens by decoder, legs}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for pipeline in Pipeline:
        row = out[pipeline.value] = {}
        for name, faults in FAULTS.items():
            p = predict(pipeline, faults, max_tokens=max_tokens)
            row[name] = {
                "outcome": p.outcome.value,
                "reason": p.reason.value if p.reason is not None else "",
                "fallbacks": [f.value for f in p.fallbacks],
                "tokens": dict(p.tokens),
                "legs": p.legs,
            }
    return out
