"""One request on a decoder (RelayDecode or MainDecode), as a sans-I/O machine.

Theory of operation. The decoder's inputs arrive in any order: the router's Attach (prompt,
sampling, deadline; it opens the token stream), P's KV transfer, and handoff slices (P's first
token, RLD's tokens, or the router's on a fallback). Once both the prompt and the KV are here the
driver imports the KV (``take_kv``); slices wait for that import. Each slice passes
``HandoffIntake`` (it must continue exactly where this decoder stands) and ``on_slice`` says what
to do with it (``SliceStep``): extend the engine with its ids, or nothing to extend because the
request is already complete (max tokens, stop token), or release because the sender finished it.
The final slice starts decoding here. ``end`` closes the request exactly once and says whether the
engine keeps the finished sequence in its prefix cache (MD only, and only for a clean end).

States (``SEQ_TRANSITIONS``)::

    WAITING --prompt and KV here--> IMPORTING --imported--> READY --final slice--> DECODING
    WAITING --Attach asks for a recompute (MD prefills itself)--> IMPORTING
    any state but ENDED --end(how)--> ENDED      (finished | handed off | released | failed)

Time is passed in: ``deadline`` is absolute, on the driver's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from pddlink.handoff import HandoffIntake, HandoffSlice
from pddlink.lifecycle.outcomes import HandoffOutcome, HandoffResult, StreamClosed, StreamEnd
from pddlink.roles import Role
from pddlink.sampling import SamplingParams

ORPHAN_DEADLINE_S = 60.0  # a KV transfer or slice that arrives before its Attach waits this long

K = TypeVar("K")  # the driver's KV payload (opaque here)


class SeqState(Enum):
    WAITING = "waiting"  # the prompt or the KV is not here yet
    IMPORTING = "importing"
    READY = "ready"  # KV imported: extending with slices
    DECODING = "decoding"  # in the decode batch
    ENDED = "ended"


SEQ_TRANSITIONS: dict[SeqState, frozenset[SeqState]] = {
    SeqState.WAITING: frozenset({SeqState.IMPORTING, SeqState.ENDED}),
    SeqState.IMPORTING: frozenset({SeqState.READY, SeqState.ENDED}),
    SeqState.READY: frozenset({SeqState.DECODING, SeqState.ENDED}),
    SeqState.DECODING: frozenset({SeqState.ENDED}),
    SeqState.ENDED: frozenset(),
}


class SliceStep(Enum):
    EXTEND = "extend"  # extend the engine with the slice's ids (then decode if final)
    COMPLETE = "complete"  # nothing left to generate: no extend (finish if final)
    RELEASE = "release"  # the sender finished the request: keep only the cached prefix


@dataclass(frozen=True, slots=True)
class EndPlan:
    """How to close: the stream's closing reason, and whether the engine caches the sequence."""

    closed: StreamClosed
    cache_prefix: bool


@dataclass(slots=True)
class DecodeSequence(Generic[K]):
    request_id: str
    role: Role
    deadline: float
    prompt: tuple[int, ...] = ()
    sampling: SamplingParams | None = None
    kv: K | None = None
    state: SeqState = SeqState.WAITING
    import_error: str = ""
    generated: list[int] = field(default_factory=list)  # ids at positions base, base+1, ...
    intake: HandoffIntake | None = None
    finished: bool = False
    closed: StreamClosed | None = None

    @classmethod
    def orphan(cls, request_id: str, role: Role, now: float) -> DecodeSequence[K]:
        """A sequence created by its KV or a slice, before the Attach that gives its deadline."""
        return cls(request_id, role, deadline=now + ORPHAN_DEADLINE_S)

    @property
    def base(self) -> int:
        return len(self.prompt)

    @property
    def ended(self) -> bool:
        return self.state is SeqState.ENDED

    @property
    def imported(self) -> bool:
        """The import is over (done or failed): slices may be looked at."""
        return self.state in (SeqState.READY, SeqState.DECODING) or bool(self.import_error)

    # -- inputs ----------------------------------------------------------------------------------

    def attach(
        self, prompt: tuple[int, ...], sampling: SamplingParams, deadline: float, *, recompute: bool = False
    ) -> bool:
        """The router's Attach; ``True``: import now. ``recompute`` (MD, ship or recompute): no KV
        comes, the driver prefills the prompt itself: WAITING -> IMPORTING at once, and
        ``import_done`` / ``import_failed`` end it as for a KV import."""
        self.prompt, self.sampling, self.deadline = prompt, sampling, deadline
        if recompute and self.state is SeqState.WAITING:
            self.kv = None
            self._to(SeqState.IMPORTING)
            return False
        return self._import_due()

    def kv_arrived(self, kv: K) -> bool:
        """P's KV transfer; ``True``: import now. Ignored once the request ended."""
        if self.ended:
            return False
        self.kv = kv
        return self._import_due()

    def take_kv(self) -> K:
        """The driver starts the import: the payload moves to the engine, the machine drops it."""
        assert self.kv is not None
        kv, self.kv = self.kv, None
        self._to(SeqState.IMPORTING)
        return kv

    def import_done(self) -> None:
        if not self.ended:
            self._to(SeqState.READY)

    def import_failed(self, error: str) -> StreamClosed:
        self.import_error = f"import_failed: {error}"
        return StreamClosed(StreamEnd.FAILED, self.import_error)

    def refusal(self) -> str:
        """Why a slice cannot be taken now ("" when it can)."""
        if self.import_error or self.ended:
            return self.import_error or f"request already ended ({self.render_end()})"
        return ""

    def on_slice(self, s: HandoffSlice, *, sender_finished: bool) -> SliceStep:
        """Check ``s`` (``HandoffError`` if it does not continue the sequence) and record its ids."""
        if sender_finished:
            return SliceStep.RELEASE
        if self.intake is None:
            self.intake = HandoffIntake(self.request_id, self.base)
        ids = self.intake.accept(s)
        self.generated[s.first_position - self.base :] = list(ids)
        if not self._complete(ids):
            return SliceStep.EXTEND
        if s.final:
            self.finished = True
        return SliceStep.COMPLETE

    def start_decoding(self) -> bool:
        """After the final slice's extend: ``True`` when the request goes into the decode batch."""
        if self.finished or self.ended:
            return False
        self._to(SeqState.DECODING)
        return True

    def on_token(self, token_id: int, finished: bool) -> None:
        self.generated.append(token_id)
        self.finished = self.finished or finished

    def end(self, closed: StreamClosed) -> EndPlan | None:
        """Close the request (``None``: it already ended; the first end wins)."""
        if self.ended:
            return None
        self.state = SeqState.ENDED
        self.closed = closed
        clean = closed.end in (StreamEnd.FINISHED, StreamEnd.RELEASED)
        return EndPlan(closed, cache_prefix=self.role is Role.MD and clean)

    def render_end(self) -> str:
        return self.closed.render() if self.closed is not None else ""

    # -- helpers -------------------------------------------------------------------------------

    def _import_due(self) -> bool:
        return bool(self.prompt) and self.kv is not None and self.state is SeqState.WAITING

    def _complete(self, ids: tuple[int, ...]) -> bool:
        sampling = self.sampling
        if sampling is None:
            return False
        return len(self.generated) >= sampling.max_tokens or (
            bool(ids) and ids[-1] in sampling.stop_token_ids
        )

    def _to(self, state: SeqState) -> None:
        if state not in SEQ_TRANSITIONS[self.state]:
            raise AssertionError(f"{self.request_id}: {self.state.name} -> {state.name}")
        self.state = state


def handoff_refused(ended: StreamClosed | None) -> HandoffResult:
    """RLD's answer to StartHandoff for a request it no longer holds (``ended``: how it ended
    here, ``None`` if unknown): finished on RLD before MD was ready, or failed (the reason: how the
    stream ended, as its text)."""
    if ended is not None and ended.end is StreamEnd.FINISHED:
        return HandoffResult(HandoffOutcome.FINISHED_ON_RLD)
    return HandoffResult(HandoffOutcome.FAILED, ended.render() if ended is not None else "unknown_request")
