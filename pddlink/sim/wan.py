"""The simulated cross-datacenter line: fair sharing over a pool of connections.

Fluid model, a few events per transfer, used by every deployment that crosses the WAN:

- The line carries ``rate`` bytes/s of goodput. One connection never exceeds ``cap`` (its TCP
  window over the RTT). With ``n`` transfers sending, up to ``pool_size`` of them have a connection
  of their own and each gets ``min(cap, rate / n)``; beyond that they share the pool:
  ``min(pool_size * cap, rate) / n`` each.
- ``fifo=False`` (multiplexed, the default): every transfer starts sending at once, beyond the pool
  as streams on the pooled connections (HTTP/2 / striped-TCP style). ``fifo=True``: a transfer holds
  one connection from its first byte to its last and waits FIFO for a free one when all are held.
  Which of the two reproduces the published skewed-vs-uniform microbenchmark better is discussed
  above ``SKEW_POOL_SIZE`` in ``pddlink.sim.scenario``.
- Each transfer's completion notice crosses back: ``done`` fires half an RTT after its last byte.

``LineStats`` are cumulative: ``busy_s`` (something sending), ``pool_full_s`` (every connection
carrying a transfer), ``held_s`` (the integral of connections carrying a transfer, so
``held_s / (pool_size * window)`` is the mean connection utilisation), ``flows_s`` (the integral of
transfers in flight, waiting ones included), ``wait_s`` (summed waits for a connection, FIFO only).
Subtract two snapshots to get a window's figures.

A virtual clock of "bytes served per sending transfer" makes a join or a completion O(log n); a
change of state bumps the version, and a timer armed before it is ignored when it fires.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from pddlink.errors import ConfigError
from pddlink.routing import LinkEstimate
from pddlink.sim.resources import Clock

Callback = Callable[[float, Any], None]


@dataclass(frozen=True, slots=True)
class LineStats:
    delivered_bytes: float = 0.0
    busy_s: float = 0.0
    pool_full_s: float = 0.0
    held_s: float = 0.0
    flows_s: float = 0.0
    wait_s: float = 0.0
    transfers: int = 0

    def __sub__(self, other: LineStats) -> LineStats:
        return LineStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


class WanLine:
    """The cross-datacenter line (see the module docstring)."""

    def __init__(
        self,
        clock: Clock,
        rate_bytes_s: float,
        rtt_s: float,
        pool_size: int,
        flow_cap_bytes_s: float,
        fifo: bool = False,
    ) -> None:
        if rate_bytes_s <= 0 or flow_cap_bytes_s <= 0 or rtt_s < 0 or pool_size < 1:
            raise ConfigError("WanLine: rates must be > 0, rtt_s >= 0 and pool_size >= 1")
        self.clock, self.rate, self.rtt_s = clock, rate_bytes_s, rtt_s
        self.pool_size, self.cap, self.fifo = pool_size, flow_cap_bytes_s, fifo
        self._served = 0.0  # bytes served to each sending transfer since the start (virtual clock)
        self._t = 0.0
        self._active: list[tuple[float, int, Callback, Any]] = []  # heap of (finish_served, id, fn, arg)
        self._finish_sum = 0.0
        self._ids = 0
        self._version = 0
        self._r = 0.0
        self._waiting: deque[tuple[int, float, Callback, Any]] = deque()  # (bytes, since, fn, arg)
        self._waiting_bytes = 0
        self.delivered_bytes = 0.0
        self.busy_s = self.pool_full_s = self.held_s = self.flows_s = self.wait_s = 0.0
        self.transfers = 0

    @property
    def now(self) -> float:
        """The time the line's figures are accounted up to."""
        return self._t

    @property
    def sending(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stats(self, now: float) -> LineStats:
        self._advance(now)
        return LineStats(
            self.delivered_bytes, self.busy_s, self.pool_full_s, self.held_s, self.flows_s, self.wait_s,
            self.transfers,
        )  # fmt: skip

    def _flow_rate(self) -> float:
        n = len(self._active)
        return min(self.rate, self.cap * min(n, self.pool_size)) / n if n else 0.0

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt <= 0:
            return
        n = len(self._active)
        if n:
            r = self._r  # the rate in force since the last change (set by _arm)
            self._served += r * dt
            self.delivered_bytes += r * dt * n
            self.busy_s += dt
            held = min(n, self.pool_size)
            self.held_s += held * dt
            self.flows_s += (n + len(self._waiting)) * dt
            if held == self.pool_size:
                self.pool_full_s += dt
        self._t = now

    def send(self, nbytes: int, now: float, done: Callback, arg: Any) -> None:
        """Start (or, FIFO with every connection held, queue) a transfer of ``nbytes``;
        ``done(t, arg)`` when the notice of its last byte is back."""
        self._advance(now)
        self.transfers += 1
        if self.fifo and len(self._active) >= self.pool_size:
            self._waiting.append((nbytes, now, done, arg))
            self._waiting_bytes += nbytes
            return
        self._join(nbytes, done, arg)
        self._arm()

    def _join(self, nbytes: int, done: Callback, arg: Any) -> None:
        self._ids += 1
        finish = self._served + nbytes
        heapq.heappush(self._active, (finish, self._ids, done, arg))
        self._finish_sum += finish

    def _arm(self) -> None:
        self._version += 1
        self._r = r = self._flow_rate()
        if self._active:
            t = self._t + max(0.0, self._active[0][0] - self._served) / r
            self.clock.at(t, self._on_timer, self._version)

    def _on_timer(self, now: float, version: int) -> None:
        if version != self._version:
            return
        self._advance(now)
        finished = []
        while self._active and self._active[0][0] <= self._served + 1.0:  # within a byte
            item = heapq.heappop(self._active)
            self._finish_sum -= item[0]
            finished.append(item)
        while self._waiting and len(self._active) < self.pool_size:
            nbytes, since, done, arg = self._waiting.popleft()
            self._waiting_bytes -= nbytes
            self.wait_s += now - since
            self._join(nbytes, done, arg)
        self._arm()
        for _, _, done, arg in finished:
            done(now + self.rtt_s / 2, arg)  # the completion notice crosses back

    def in_flight(self, now: float) -> list[tuple[Any, float]]:
        """Each transfer on the line (sending or waiting): its ``arg`` and the bytes it has left."""
        self._advance(now)
        out = [(arg, max(0.0, finish - self._served)) for finish, _, _, arg in self._active]
        return out + [(arg, float(n)) for n, _, _, arg in self._waiting]

    def estimate(self, now: float) -> LinkEstimate:
        """What the router sees. Multiplexed, nobody waits for a connection, so the pool the policy
        is told about always has room; FIFO, the waiting transfers count as in flight."""
        self._advance(now)
        backlog = max(0.0, self._finish_sum - len(self._active) * self._served) + self._waiting_bytes
        flows = len(self._active) + len(self._waiting)
        return LinkEstimate(
            line_bytes_per_s=min(self.rate, self.pool_size * self.cap),
            rtt_s=self.rtt_s,
            flows_in_flight=flows,
            backlog_bytes=int(backlog),
            pool_size=self.pool_size if self.fifo else max(self.pool_size, flows + 1),
            flow_cap_bytes_per_s=self.cap,
        )
