"""What ``pddlink chaos --topology`` measures of its faults of one instance out of several (pure:
from what the clients saw, each request's final trace with its placement).

A request's placement history (``placed_on``): its final P and MD, the instances it moved off
mid-request (``placement.moved``: ``{"role", "from", "to"}``) and those of the runs it was
re-placed from before its first token (``placement.replaced_from``: ``{"p", "md"}``).

md_kill_rescued_share  of the requests in flight when the MD was killed that had it in their
                       history, a pipeline through an MD (not singular) and still needed it, the
                       share that finished with their final MD another one. Not needing it: a
                       relayed request RLD finished alone as relayed runs do when the output ends
                       before the handoff (no MD token, no fallback, no move): the kill took
                       nothing from it (``rld_alone``, counted apart); nor from a request whose
                       last token the killed MD itself sent, ending within ``KILL_REACH_S`` of the
                       kill with no fallback and no move (``done_before_kill``, counted apart: a
                       SIGKILLed process sends nothing, so that token left before the signal
                       landed; one run saw a request end 7 ms after the kill this way and counted
                       it not rescued). ``md_kill_strict_share``: the same share with both counted
                       as not rescued;
                       ``md_kill_finished_share``: the share that finished at all
p_kill_rescued_share   of those in flight on the killed P, the share that finished (a request
                       whose prefill was done needs P no longer; the others must move to the other
                       P to finish: ``p_kill_moved`` counts those that did)
drain_failed           requests with the drained instance in their history, in flight during the
                       drain, that did not finish; ``drain_new_placed``: requests that began
                       during the drain and were placed on it anyway (0: nothing new goes there)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.chaos.invariants import FaultRecord, failure_reasons
from harness.chaos.load import StreamResult

DRAIN_SETTLE_S = 0.5  # a request placed this soon after the drain began was placed before it
KILL_REACH_S = 0.25  # a token the killed MD sent just before the signal reaches the client this late


def history(trace: dict[str, Any], role: str) -> list[str]:
    """Every instance of ``role`` ("p" or "md") the request was placed on, first to last."""
    placement = trace.get("placement") or {}
    names = [r[role] for r in placement.get("replaced_from") or [] if role in r]
    names += [m["from"] for m in placement.get("moved") or [] if m.get("role") == role]
    if placement.get(role):
        names.append(placement[role])
    return names


def placed_on(r: StreamResult, role: str, name: str) -> bool:
    return name in history(r.trace, role)


def final(r: StreamResult, role: str) -> str:
    return str((r.trace.get("placement") or {}).get(role) or "")


def rld_alone(r: StreamResult) -> bool:
    """A relayed request RLD finished alone, as it does when the output ends before the handoff:
    no token from an MD, no fallback, no move."""
    t = r.trace
    placement = t.get("placement") or {}
    return (
        r.outcome == "finished"
        and not r.sources.get("md")
        and not t.get("fallbacks")
        and not placement.get("moved")
        and t.get("pipeline") == "p_rld_md"
    )


def done_before_kill(r: StreamResult, fault: FaultRecord) -> bool:
    """A request the killed MD itself finished: its last token came from that MD (no fallback, no
    move) and reached the client within ``KILL_REACH_S`` of the kill."""
    t = r.trace
    return (
        r.outcome == "finished"
        and final(r, "md") == fault.target
        and bool(r.sources.get("md"))
        and not t.get("fallbacks")
        and not (t.get("placement") or {}).get("moved")
        and r.ended_s <= fault.start_s + KILL_REACH_S
    )


def kill_share(results: Sequence[StreamResult], fault: FaultRecord, role: str) -> dict[str, Any]:
    """The killed instance's in-flight requests and how they ended (see the module docstring)."""
    caught = [r for r in fault.in_flight(results) if placed_on(r, role, fault.target)]
    alone: list[StreamResult] = []
    before: list[StreamResult] = []
    if role == "md":
        caught = [r for r in caught if r.trace.get("pipeline") != "singular"]
        alone = [r for r in caught if rld_alone(r)]
        before = [r for r in caught if done_before_kill(r, fault)]
    finished = [r for r in caught if r.outcome == "finished"]
    moved = [r for r in finished if final(r, role) != fault.target]
    rescued = moved if role == "md" else finished
    needed = len(caught) - len(alone) - len(before)
    reasons = failure_reasons(caught)
    return {
        "instance": fault.target,
        "in_flight": len(caught),
        "finished": len(finished),
        "moved": len(moved),
        "rld_alone": len(alone),
        "done_before_kill": len(before),
        "rescued_share": round(len(rescued) / needed, 4) if needed else 0.0,
        "strict_share": round(len(rescued) / len(caught), 4) if caught else 0.0,
        "finished_share": round(len(finished) / len(caught), 4) if caught else 0.0,
        "failed_reasons": reasons,
    }


def drain_outcome(results: Sequence[StreamResult], fault: FaultRecord) -> dict[str, Any]:
    during = [r for r in results if r.started_s < fault.end_s and fault.start_s < r.ended_s]
    on_it = [r for r in during if any(placed_on(r, role, fault.target) for role in ("p", "md"))]
    new = [r for r in on_it if r.started_s > fault.start_s + DRAIN_SETTLE_S]
    return {
        "instance": fault.target,
        "in_flight": len(on_it),
        "failed": sum(r.outcome != "finished" for r in on_it),
        "new_placed": len(new),
    }


def pool_measures(
    results: Sequence[StreamResult],
    faults: Sequence[FaultRecord],
    rejoin_s: Mapping[str, float | None],
    roles: Mapping[str, str],
) -> dict[str, Any]:
    """The keys ``checks/chaos-pools`` reads, and the detail behind them; ``roles``: each
    instance's role ("p", "rld", "md"); ``rejoin_s``: per restarted instance, seconds from its
    restart to its first placed request (None: none within the wait)."""
    out: dict[str, Any] = {}
    for fault in faults:
        if fault.kind == "kill_instance" and roles.get(fault.target) in ("p", "md"):
            role = roles[fault.target]
            out[f"{role}_kill"] = kill_share(results, fault, role)
        elif fault.kind == "drain":
            out["drain"] = drain_outcome(results, fault)
    out["md_kill_rescued_share"] = out.get("md_kill", {}).get("rescued_share", 0.0)
    out["md_kill_strict_share"] = out.get("md_kill", {}).get("strict_share", 0.0)
    out["md_kill_finished_share"] = out.get("md_kill", {}).get("finished_share", 0.0)
    out["p_kill_rescued_share"] = out.get("p_kill", {}).get("rescued_share", 0.0)
    out["p_kill_moved"] = out.get("p_kill", {}).get("moved", 0)
    out["drain_failed"] = out.get("drain", {}).get("failed", 0) if "drain" in out else None
    out["drain_new_placed"] = out.get("drain", {}).get("new_placed", 0) if "drain" in out else None
    out["rejoin_by_instance_s"] = dict(rejoin_s)
    known = [v for v in rejoin_s.values() if v is not None]
    out["rejoin_s"] = max(known) if known and len(known) == len(rejoin_s) else None
    return out
