"""One direction of a WAN line shared by byte streams: a pure scheduler, ``now`` passed in.

A real line is one queue per direction served at the line rate, whatever flows cross it (netns
mode's tbf qdisc is too). In loopback mode the relay terminates every TCP connection, so it must
decide itself whose bytes go on the line next; ``SharedLine`` makes that decision for bytes already
read from the connections' sockets:

- flows take turns, ``quantum_bytes`` at a time (deficit round robin; a byte stream splits
  anywhere, so no deficit carries over): n backlogged flows get 1/n of the rate each, a flow alone
  all of it;
- the queue in front of the line is bounded: ``room(flow)`` is what a flow may still add, its fair
  share of ``queue_bytes`` among the flows contending (backlogged, or waiting for room), and never
  past the bound in all. The relay stops reading a flow's socket while it has no room, so TCP flow
  control pushes back to that flow's sender and nothing is dropped;
- during an outage the line sends nothing and earns no credit for the time it was cut.

Lifecycle: ``open`` a flow; ``offer`` it bytes up to ``room`` (``want`` when there is none, so that
it counts as contending); call ``advance(now, cut)`` after each offer and at ``next_s()``: it
answers the pieces that went on the line, in line order; ``close`` the flow (its unsent bytes go).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pddlink.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Sent:
    """``nbytes`` of ``flow``'s stream (the next ones, in order) left the line at ``leave_s``."""

    flow: int
    nbytes: int
    leave_s: float


class SharedLine:
    """A line of ``rate_bytes_s`` (wire bytes; 0: unlimited) in one direction and its shared queue.
    A piece of n payload bytes costs n plus ``header_bytes`` per ``segment_bytes`` on the wire."""

    def __init__(
        self,
        rate_bytes_s: float,
        queue_bytes: int,
        quantum_bytes: int,
        segment_bytes: int = 1448,
        header_bytes: int = 0,
    ) -> None:
        self._pending: dict[int, int] = {}  # flow -> bytes offered, not yet on the line
        self._turns: deque[int] = deque()  # backlogged flows, in turn order
        self._wanting: set[int] = set()
        self._next_flow = 0
        self._total = 0
        self._busy_until_s = 0.0
        self.configure(rate_bytes_s, queue_bytes, quantum_bytes, segment_bytes, header_bytes)

    def configure(
        self,
        rate_bytes_s: float,
        queue_bytes: int,
        quantum_bytes: int,
        segment_bytes: int = 1448,
        header_bytes: int = 0,
    ) -> None:
        """Set (or change, on a running line) the rate and the queue; what is queued stays."""
        if rate_bytes_s < 0 or queue_bytes < 1 or quantum_bytes < 1 or segment_bytes < 1 or header_bytes < 0:
            raise InvalidInput("shared line: rate >= 0, queue, quantum and segment >= 1, header >= 0")
        self.rate_bytes_s, self.queue_bytes, self.quantum_bytes = rate_bytes_s, queue_bytes, quantum_bytes
        self._segment, self._header = segment_bytes, header_bytes

    # flows

    def open(self) -> int:
        self._next_flow += 1
        self._pending[self._next_flow] = 0
        return self._next_flow

    def close(self, flow: int) -> None:
        self._total -= self._pending.pop(flow, 0)
        self._wanting.discard(flow)
        if flow in self._turns:
            self._turns.remove(flow)

    def pending(self, flow: int) -> int:
        return self._pending[flow]

    @property
    def queued_bytes(self) -> int:
        """Bytes offered by every flow and not yet on the line."""
        return self._total

    @property
    def backlogged(self) -> bool:
        return bool(self._turns)

    def _contenders(self, flow: int) -> int:
        others = self._wanting | set(self._turns)
        return len(others | {flow})

    def bound_bytes(self, flow: int) -> int:
        """The queue's bound in all while ``flow`` contends (at least a quantum per contender)."""
        return max(self.queue_bytes, self._contenders(flow) * self.quantum_bytes)

    def room(self, flow: int) -> int:
        """How many more bytes ``flow`` may offer now."""
        n = self._contenders(flow)
        share = max(self.quantum_bytes, self.queue_bytes // n)
        bound = max(self.queue_bytes, n * self.quantum_bytes)
        return max(0, min(share - self._pending[flow], bound - self._total))

    def want(self, flow: int) -> None:
        """``flow`` has bytes to offer but no room: it counts as contending until it offers."""
        self._wanting.add(flow)

    def offer(self, flow: int, nbytes: int, now_s: float) -> None:
        if not 0 < nbytes <= self.room(flow):
            raise InvalidInput(f"flow {flow}: offered {nbytes} bytes with room for {self.room(flow)}")
        self._wanting.discard(flow)
        if not self._turns:
            self._busy_until_s = max(self._busy_until_s, now_s)  # an idle line starts now
        if not self._pending[flow]:
            self._turns.append(flow)
        self._pending[flow] += nbytes
        self._total += nbytes

    # the line

    def next_s(self) -> float | None:
        """When ``advance`` has the next piece to send (None: nothing queued)."""
        return self._busy_until_s if self._turns else None

    def advance(self, now_s: float, cut: bool = False) -> list[Sent]:
        """The pieces that go on the line by ``now_s``; each goes when the one before has left."""
        if cut:
            self._busy_until_s = max(self._busy_until_s, now_s)
            return []
        sent: list[Sent] = []
        while self._turns and self._busy_until_s <= now_s:
            flow = self._turns.popleft()
            unlimited = self.rate_bytes_s <= 0
            n = self._pending[flow] if unlimited else min(self.quantum_bytes, self._pending[flow])
            if not unlimited:
                wire = n + -(-n // self._segment) * self._header
                self._busy_until_s += wire / self.rate_bytes_s
            self._pending[flow] -= n
            self._total -= n
            if self._pending[flow]:
                self._turns.append(flow)
            sent.append(Sent(flow, n, now_s if unlimited else self._busy_until_s))
        return sent


__all__ = ["Sent", "SharedLine"]
