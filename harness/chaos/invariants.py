"""The invariants ``pddlink chaos`` checks, computed from what the clients saw (pure).

hung             a request that did not end within its deadline + 1 s (or never closed)
token_mismatches a finished request whose tokens differ from one engine generating it alone
gaps/duplicates  positions missing / repeated in a stream (finished or not)
untyped          a failure or refusal without a reason
outage share     of the requests in flight when the longer-than-deadline outage began that had
                 RelayDecode (an RLD stream: p_rld_md or singular, no rld_error), how many finished
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.chaos.load import StreamResult

HUNG_SLACK_S = 1.0


@dataclass(frozen=True, slots=True)
class FaultRecord:
    name: str
    kind: str
    target: str
    start_s: float  # on the load's clock
    end_s: float
    note: str = ""

    def in_flight(self, results: Sequence[StreamResult]) -> list[StreamResult]:
        return [r for r in results if r.started_s <= self.start_s < r.ended_s]


def stream_gaps(r: StreamResult, base: int) -> tuple[int, int]:
    """(missing positions, repeated positions) of one stream that should start at ``base``."""
    gaps = dups = 0
    expect = base
    for pos in r.positions:
        if pos < expect:
            dups += 1
            continue
        gaps += pos - expect
        expect = pos + 1
    return gaps, dups


def is_hung(r: StreamResult, deadline_s: float) -> bool:
    return r.outcome in ("", "hung") or r.e2e_s > deadline_s + HUNG_SLACK_S


def had_rld(r: StreamResult, rld_down: Sequence[FaultRecord]) -> bool:
    """RelayDecode was there for it: no kill of RLD overlapped the request's lifetime."""
    return not any(f.start_s < r.ended_s and r.started_s < f.end_s for f in rld_down)


def outage_share(
    results: Sequence[StreamResult], outage: FaultRecord | None, rld_down: Sequence[FaultRecord] = ()
) -> tuple[float, int]:
    """(share finished, how many) of the requests in flight when ``outage`` began that had
    RelayDecode available (0.0, 0 when there were none)."""
    if outage is None:
        return 0.0, 0
    stranded = [r for r in outage.in_flight(results) if had_rld(r, rld_down)]
    if not stranded:
        return 0.0, 0
    return sum(r.outcome == "finished" for r in stranded) / len(stranded), len(stranded)


def failure_reasons(results: Sequence[StreamResult]) -> dict[str, int]:
    """How many of ``results`` did not finish, by reason (its text up to the first colon)."""
    reasons: dict[str, int] = {}
    for r in results:
        if r.outcome != "finished":
            key = (r.reason or "(none)").split(":")[0][:60]
            reasons[key] = reasons.get(key, 0) + 1
    return reasons


def fault_outcomes(fault: FaultRecord, results: Sequence[StreamResult]) -> dict[str, Any]:
    caught = fault.in_flight(results)
    reasons = failure_reasons(caught)
    return {
        "name": fault.name,
        "kind": fault.kind,
        "target": fault.target,
        "start_s": round(fault.start_s, 3),
        "end_s": round(fault.end_s, 3),
        "in_flight": len(caught),
        "finished": sum(r.outcome == "finished" for r in caught),
        "failed_reasons": reasons,
        "note": fault.note,
    }


def evaluate(
    results: Sequence[StreamResult],
    reference: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    faults: Sequence[FaultRecord],
    *,
    deadline_s: float,
) -> dict[str, Any]:
    """The report's request-side keys (held state and RSS are added by the runner)."""
    hung = [r for r in results if is_hung(r, deadline_s)]
    finished = [r for r in results if r.outcome == "finished" and not is_hung(r, deadline_s)]
    refused = [r for r in results if r.outcome == "refused"]
    gaps = dups = 0
    for r in results:
        g, d = stream_gaps(r, prompt_lengths[r.index])
        gaps, dups = gaps + g, dups + d
    long_outage = next((f for f in faults if f.name == "wan_outage_long"), None)
    rld_down = [f for f in faults if f.kind == "kill_restart" and f.target == "rld"]
    share, stranded = outage_share(results, long_outage, rld_down)
    reasons = failure_reasons(results)
    return {
        "requests": len(results),
        "finished": len(finished),
        "failed": len(results) - len(finished) - len(refused) - len(hung),
        "refused": len(refused),
        "hung": len(hung),
        "untyped_failures": sum(1 for r in results if r.outcome != "finished" and not r.reason),
        "token_mismatches": sum(1 for r in finished if list(r.tokens) != list(reference[r.index])),
        "gaps": gaps,
        "duplicates": dups,
        "outage_rld_finish_share": share,
        "outage_rld_in_flight": stranded,
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "faults": [fault_outcomes(f, results) for f in faults],
    }
