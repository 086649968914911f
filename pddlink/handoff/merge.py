"""Merging the token streams of RelayDecode and MainDecode into one client stream.

Every token arrives with its absolute position. The merger emits each position exactly once and in
order (no gap, no duplicate): a token ahead of the next position waits until the gap fills; a token
at a position already emitted is a duplicate, dropped and checked against what was emitted (a
different id there means the two instances diverged: counted, never emitted). Pure: the router's
per-request task feeds it, one instance per request, and sends what ``offer`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pddlink.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class MergedToken:
    position: int
    token_id: int
    source: str  # "rld" | "md" | ... (the instance that produced it)


@dataclass(slots=True)
class StreamMerger:
    """One request's merged stream, starting at ``base_position`` (the first generated token)."""

    base_position: int
    max_tokens: int
    next_position: int = -1
    emitted: list[int] = field(default_factory=list)
    by_source: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    divergences: int = 0
    finished: bool = False
    _ahead: dict[int, tuple[int, str, bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.base_position < 1 or self.max_tokens < 1:
            raise InvalidInput("base_position and max_tokens must be >= 1")
        if self.next_position < 0:
            self.next_position = self.base_position

    @property
    def generated(self) -> int:
        return len(self.emitted)

    def offer(self, position: int, token_id: int, source: str, *, last: bool = False) -> list[MergedToken]:
        """Feed one token; returns the tokens that become emittable, in order. ``last`` marks the
        request's final token (max tokens or a stop token at the producer)."""
        if position < self.base_position:
            raise InvalidInput(
                f"position {position} precedes the first generated position {self.base_position}"
            )
        if position < self.next_position:
            self.duplicates += 1
            if self.emitted[position - self.base_position] != token_id:
                self.divergences += 1
            return []
        if self.finished or position >= self.base_position + self.max_tokens:
            return []  # beyond the end: a producer that went on past a finish it did not know of
        if position in self._ahead:
            self.duplicates += 1
            if self._ahead[position][0] != token_id:
                self.divergences += 1
            return []
        self._ahead[position] = (token_id, source, last)
        return self._drain()

    def _drain(self) -> list[MergedToken]:
        out: list[MergedToken] = []
        while not self.finished and self.next_position in self._ahead:
            token_id, source, last = self._ahead.pop(self.next_position)
            out.append(MergedToken(self.next_position, token_id, source))
            self.emitted.append(token_id)
            self.by_source[source] = self.by_source.get(source, 0) + 1
            self.next_position += 1
            if last or self.generated >= self.max_tokens:
                self.finished = True
                self._ahead.clear()
        return out

    def resume_point(self) -> tuple[int, ...]:
        """Tokens emitted so far: what a fallback must treat as given (re-prefilled or extended)."""
        return tuple(self.emitted)
