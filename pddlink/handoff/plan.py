"""Handoff planning: which generated tokens RelayDecode sends to MainDecode, and when it stops.

Lifecycle on RLD, one request (pure; the sidecar drives it and does the I/O)::

    plan = HandoffPlan(request_id, base_position=len(prompt), mode=..., slice_tokens=64)
    ...  RLD decodes; MD reports that it holds the prompt KV
    while (s := plan.next_slice(generated_upto)) is not None:
        send s to MD; MD extends s.token_ids in one forward pass; plan.on_ack(s.end_position)
        if s.final: RLD stops decoding this request and releases it

Positions are absolute indices in the request's token list: the first generated token (P's ``t0``)
sits at ``base_position``. A slice covers ``[first_position, end_position)``; MD extends those ids
and samples the token at ``end_position`` itself. Consecutive slices are contiguous (no gap, no
overlap in positions): the next slice starts where the previous ended, and its first id equals the
token MD sampled there (the engine contract's one-token overlap of catch-up slices).

One-shot sends everything RLD generated in one final slice and RLD stops at once (MD stalls for
one extend). Catch-up keeps RLD decoding and sends full slices of ``slice_tokens`` while RLD is
more than a slice ahead; when the gap is at most one slice (or after ``max_slices``, so a decode
faster than MD's extend cannot chase forever), the rest goes in the final slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from pddlink.errors import ErrorCode, InvalidInput, LocalError


class HandoffMode(StrEnum):
    ONE_SHOT = "one_shot"
    CATCH_UP = "catch_up"


class HandoffError(LocalError):
    """A slice that does not continue the sequence (gap, overlap, ids that differ)."""

    code = ErrorCode.PROTOCOL


@dataclass(frozen=True, slots=True)
class HandoffSlice:
    """Generated token ids for positions ``[first_position, first_position + len(token_ids))``."""

    request_id: str
    first_position: int
    token_ids: tuple[int, ...]
    final: bool
    mode: HandoffMode

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidInput("handoff slice needs a request_id")
        if self.first_position < 0:
            raise InvalidInput(f"first_position must be >= 0, got {self.first_position}")
        if not self.token_ids:
            raise InvalidInput("a handoff slice carries at least one token id")
        if any(t < 0 for t in self.token_ids):
            raise InvalidInput("token ids must be >= 0")

    @property
    def end_position(self) -> int:
        return self.first_position + len(self.token_ids)


@dataclass(slots=True)
class HandoffPlan:
    """RLD-side plan of one request's handoff. Mutable, owned by one request's task."""

    request_id: str
    base_position: int
    mode: HandoffMode
    slice_tokens: int = 64
    max_slices: int = 16  # catch-up that has not levelled after this many slices ends with a final one
    slices_sent: int = 0
    sent_upto: int = -1  # end position of the last slice sent; -1: nothing sent
    acked_upto: int = -1
    final_sent: bool = False

    def __post_init__(self) -> None:
        if self.base_position < 1:
            raise InvalidInput(
                f"base_position must be >= 1 (a prompt is never empty), got {self.base_position}"
            )
        if self.slice_tokens < 1 or self.max_slices < 1:
            raise InvalidInput(
                f"slice_tokens and max_slices must be >= 1, got {self.slice_tokens}, {self.max_slices}"
            )
        if self.sent_upto < 0:
            self.sent_upto = self.base_position

    @property
    def in_flight(self) -> bool:
        return self.sent_upto > max(self.acked_upto, self.base_position)

    def final_due(self, generated_count: int) -> bool:
        """Whether the next slice, cut now, would be the final one (then RLD must stop first)."""
        gap = self.base_position + generated_count - self.sent_upto
        last_allowed = self.slices_sent + 1 >= self.max_slices
        return self.mode is HandoffMode.ONE_SHOT or gap <= self.slice_tokens or last_allowed

    def next_slice(self, generated: Sequence[int]) -> HandoffSlice | None:
        """The next slice to send, given every token RLD generated so far (``generated[i]`` is at
        ``base_position + i``); ``None`` when nothing should be sent now (one slice in flight at a
        time, or the final slice already went)."""
        if self.final_sent or self.in_flight or not generated:
            return None
        upto = self.base_position + len(generated)
        if upto <= self.sent_upto:
            return None
        final = self.final_due(len(generated))
        end = upto if final else self.sent_upto + self.slice_tokens
        ids = tuple(generated[self.sent_upto - self.base_position : end - self.base_position])
        out = HandoffSlice(self.request_id, self.sent_upto, ids, final, self.mode)
        self.sent_upto = end
        self.final_sent = final
        self.slices_sent += 1
        return out

    def on_ack(self, end_position: int) -> None:
        """MD extended every slice up to ``end_position``."""
        if end_position != self.sent_upto:
            raise HandoffError(f"ack for position {end_position}, expected {self.sent_upto}")
        self.acked_upto = end_position

    @property
    def done(self) -> bool:
        return self.final_sent and self.acked_upto == self.sent_upto


@dataclass(slots=True)
class HandoffIntake:
    """MD-side check of incoming slices: they must continue exactly where MD stands."""

    request_id: str
    base_position: int
    next_position: int = -1
    finished: bool = False

    def __post_init__(self) -> None:
        if self.next_position < 0:
            self.next_position = self.base_position

    def accept(self, s: HandoffSlice) -> tuple[int, ...]:
        """Validate ``s`` and return the ids to extend with; raises ``HandoffError`` (no state change)."""
        if s.request_id != self.request_id:
            raise HandoffError(f"slice for {s.request_id!r} sent to {self.request_id!r}")
        if self.finished:
            raise HandoffError(f"{self.request_id}: slice after the final slice")
        if s.first_position != self.next_position:
            kind = "gap" if s.first_position > self.next_position else "overlap"
            raise HandoffError(
                f"{self.request_id}: slice at {s.first_position}, expected {self.next_position} ({kind})"
            )
        self.next_position = s.end_position
        self.finished = s.final
        return s.token_ids
