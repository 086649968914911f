"""How a relayed request leaves RelayDecode, decided once for both engines.

When MD holds the prompt's KV the router asks RLD's side for the handoff (``StartHandoff``). What
happens then is the same question for every engine, answered here:

``open_handoff(HandoffAsk, policy)``
    RLD already ended the request: it finished there (``FINISHED_ON_RLD``); no MD to hand it to,
    or MD's copy of the KV failed to load: the handoff fails and RLD finishes (``FAILED`` with the
    reason); at most one token left to make: RLD makes it (MD would extend for nothing). Otherwise
    one-shot or catch-up by RLD's load (``pddlink.routing.choose_handoff_mode``).

``CatchUpRace``
    Catch-up when MD decodes beside RLD from the ids it was given (vLLM: MD's extend is an ordinary
    request on the prompt plus those ids, and streams while RLD still does): MD takes over at the
    first token it makes at or past RLD's next position; RLD finishing first ends the race the other
    way (MD's stream is not needed); RLD failing leaves the request to the run machine's take-over
    row; out of time, MD goes on alone. The first verdict stands.

The reference engine's catch-up sends RLD's ids in slices instead (``pddlink.handoff.HandoffPlan``,
driven by RLD's sidecar: MD's acknowledged level is the race's MD side); its start is decided by
``open_handoff`` too. Sans-I/O: the router's vLLM legs and RLD's sidecar both drive these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pddlink.lifecycle.outcomes import HandoffOutcome, HandoffResult
from pddlink.routing import HandoffDecision, RoutingPolicy, choose_handoff_mode

__all__ = ["CatchUpRace", "HandoffAsk", "RaceVerdict", "open_handoff"]


@dataclass(frozen=True, slots=True)
class HandoffAsk:
    """What RLD's side knows when the handoff is asked for."""

    generated: int  # token ids RLD made so far
    max_tokens: int  # the request's output budget
    rld_load: float  # RLD's load (running / capacity): one-shot above the policy's line
    rld_decoding: bool = True  # False: RLD ended the request before the ask
    md_known: bool = True  # False: no MD configured or named to hand it to
    md_holds_kv: bool = True  # False: MD's load of the prompt's KV failed


def open_handoff(ask: HandoffAsk, policy: RoutingPolicy) -> HandoffResult | HandoffDecision:
    """The handoff's mode, or why there is none (the result RLD's side answers with at once)."""
    if not ask.rld_decoding:
        return HandoffResult(HandoffOutcome.FINISHED_ON_RLD)
    if not ask.md_known:
        return HandoffResult(HandoffOutcome.FAILED, "no_md_configured")
    if not ask.md_holds_kv:
        return HandoffResult(HandoffOutcome.FAILED, "md_kv_not_loaded")
    if ask.max_tokens - ask.generated <= 1:
        return HandoffResult(HandoffOutcome.FINISHED_ON_RLD)
    return choose_handoff_mode(ask.rld_load, policy)


class RaceVerdict(StrEnum):
    PENDING = "pending"
    MD_CAUGHT_UP = "md_caught_up"  # RLD stops; MD streams on (HANDED_OFF)
    RLD_FINISHED = "rld_finished"  # MD's stream stops (FINISHED_ON_RLD)
    RLD_LOST = "rld_lost"  # the run machine's take-over decides; the handoff reports nothing
    OUT_OF_TIME = "out_of_time"  # RLD stops; MD goes on alone (HANDED_OFF)


class CatchUpRace:
    """One catch-up handoff's race between RLD's stream and MD's; see the module docstring.
    Positions are absolute (prompt length + index of the output token)."""

    def __init__(self, rld_next: int) -> None:
        self.rld_next = rld_next  # the position RLD streams next
        self.verdict = RaceVerdict.PENDING

    def _decide(self, verdict: RaceVerdict) -> RaceVerdict:
        if self.verdict is RaceVerdict.PENDING:
            self.verdict = verdict
        return self.verdict

    def rld_token(self, position: int) -> RaceVerdict:
        if self.verdict is RaceVerdict.PENDING:
            self.rld_next = max(self.rld_next, position + 1)
        return self.verdict

    def md_token(self, position: int) -> RaceVerdict:
        """MD streamed ``position``: level with RLD once it reaches RLD's next position."""
        if position + 1 >= self.rld_next:
            return self._decide(RaceVerdict.MD_CAUGHT_UP)
        return self.verdict

    def rld_ended(self, finished: bool) -> RaceVerdict:
        return self._decide(RaceVerdict.RLD_FINISHED if finished else RaceVerdict.RLD_LOST)

    def out_of_time(self) -> RaceVerdict:
        return self._decide(RaceVerdict.OUT_OF_TIME)

    @property
    def handed_off(self) -> bool:
        return self.verdict in (RaceVerdict.MD_CAUGHT_UP, RaceVerdict.OUT_OF_TIME)
