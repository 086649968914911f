"""The link model: a pure, seedable state machine deciding the fate of every packet.

The relays feed it arrivals and act on its answers; it never reads a clock or touches a socket
(``now_s`` is passed in), so a seeded model replays the same fates and can be tested without I/O.

An arrival is a *burst* of ``segments`` packets of ``wire_bytes`` in all: a TUN read with offloads
is a segmentation super-packet of up to ~44 segments, a plain packet is a burst of one. The model
answers with ``Delivery`` runs (which segments arrive, when, corrupted or not); a relay splits a
super-packet only when the answer is not one run covering all of it (a loss, a queue overflow, a
reordered, duplicated or corrupted segment), which keeps the common path a single write.

Per direction, in the order a real path applies them: outage (scheduled or manual) -> drop-tail
queue in front of the bottleneck -> serialization at ``rate_mbit`` -> loss on the line (random and
Gilbert-Elliott) -> propagation delay with jitter -> reordering, duplication, corruption.
Independent per-packet events are drawn as geometric gaps, so a burst costs O(events), not O(packets).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import asdict, dataclass

from netlab.profile import DIRECTIONS, DirectionSpec, Outage, Profile
from pddlink.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Delivery:
    """Segments ``[first, first+count)`` of a burst arrive at ``at_s``; ``corrupt``: one bit flipped."""

    first: int
    count: int
    at_s: float
    corrupt: bool = False


@dataclass(slots=True)
class DirectionStats:
    """Counters in segments (packets) of one direction; ``bytes_in`` counts arrivals."""

    packets_in: int = 0
    bytes_in: int = 0
    delivered: int = 0
    dropped_outage: int = 0
    dropped_queue: int = 0
    dropped_loss: int = 0
    reordered: int = 0
    duplicated: int = 0
    corrupted: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class EventGaps:
    """Independent events of probability ``p`` per packet, drawn as geometric gaps between them."""

    def __init__(self, p: float, rng: random.Random) -> None:
        self._p = p
        self._rng = rng
        self._log_q = math.log1p(-p) if 0.0 < p < 1.0 else 0.0
        self._left = self._gap()

    def draw_gap(self) -> float:
        """A fresh gap: how many packets pass before the next event (inf: never)."""
        return self._gap()

    def _gap(self) -> float:
        if self._p <= 0.0:
            return math.inf
        if self._p >= 1.0:
            return 0
        return math.floor(math.log(1.0 - self._rng.random()) / self._log_q)

    def take(self, n: int) -> list[int]:
        """Indices in [0, n) of the next ``n`` packets at which the event happens."""
        hits: list[int] = []
        i = self._left
        while i < n:
            hits.append(int(i))
            i += 1 + self._gap()
        self._left = i - n
        return hits


class GilbertElliottLoss:
    """Two-state loss; sojourns in each state and losses within a state are geometric gaps."""

    def __init__(self, p: float, r: float, loss_good: float, loss_bad: float, rng: random.Random) -> None:
        self._leave = (EventGaps(p, rng), EventGaps(r, rng))
        self._loss = (EventGaps(loss_good, rng), EventGaps(loss_bad, rng))
        self._bad = 0
        self._stay = self._sojourn()

    def _sojourn(self) -> float:
        return self._leave[self._bad].draw_gap() + 1

    def take(self, n: int) -> list[int]:
        lost: list[int] = []
        pos = 0
        while pos < n:
            span = int(min(self._stay, n - pos))
            lost.extend(pos + i for i in self._loss[self._bad].take(span))
            pos += span
            self._stay -= span
            if self._stay <= 0:
                self._bad ^= 1
                self._stay = self._sojourn()
        return lost


class DirectionModel:
    """One direction of the link: queue, bottleneck, line, delay."""

    def __init__(self, spec: DirectionSpec, direction: str, seed: int) -> None:
        self.spec = spec
        self.direction = direction
        self.stats = DirectionStats()
        rng = random.Random(f"netlab:{seed}:{direction}")
        self._rng = rng
        self._loss = EventGaps(spec.loss, rng)
        ge = spec.gilbert_elliott
        self._ge = GilbertElliottLoss(ge.p, ge.r, ge.loss_good, ge.loss_bad, rng) if ge else None
        self._reorder = EventGaps(spec.reorder, rng)
        self._duplicate = EventGaps(spec.duplicate, rng)
        self._corrupt = EventGaps(spec.corrupt, rng)
        self._bytes_per_s = spec.rate_mbit * 125_000.0
        self._busy_until_s = 0.0
        self._queue: deque[tuple[float, int]] = deque()  # (departure_s, segments) in the queue
        self._queued = 0
        self._last_at_s = 0.0
        self._delay_s = spec.delay_ms / 1000.0
        self._jitter_s = spec.jitter_ms / 1000.0
        self._tau_s = spec.jitter_correlation_ms / 1000.0
        self._ou = rng.gauss(0.0, self._jitter_s) if self._jitter_s > 0 else 0.0
        self._ou_at_s = 0.0
        advance = spec.delay_ms if spec.reorder_advance_ms is None else spec.reorder_advance_ms
        self._advance_s = advance / 1000.0
        self.transparent = spec.is_transparent

    def _admit_queue(self, now_s: float, segments: int, wire_bytes: int) -> tuple[int, float]:
        """How many leading segments the queue takes, and when the last of them leaves the bottleneck."""
        if self._bytes_per_s <= 0.0:
            return segments, now_s
        queue = self._queue
        while queue and queue[0][0] <= now_s:
            self._queued -= queue.popleft()[1]
        seg_bytes = wire_bytes / segments
        fit = segments
        if self.spec.queue_packets:
            fit = min(fit, self.spec.queue_packets - self._queued)
        if self.spec.queue_bytes:
            backlog = max(0.0, self._busy_until_s - now_s) * self._bytes_per_s
            fit = min(fit, int((self.spec.queue_bytes - backlog) // seg_bytes))
        if fit <= 0:
            return 0, now_s
        leave_s = max(now_s, self._busy_until_s) + fit * seg_bytes / self._bytes_per_s
        self._busy_until_s = leave_s
        queue.append((leave_s, fit))
        self._queued += fit
        return fit, leave_s

    def _delay(self, now_s: float) -> float:
        j = self._jitter_s
        if j <= 0.0:
            return self._delay_s
        dist = self.spec.distribution
        if dist == "normal" and self._tau_s > 0.0:
            # Ornstein-Uhlenbeck: stationary N(0, j^2), correlated over tau, exact for any time step
            keep = math.exp(-max(0.0, now_s - self._ou_at_s) / self._tau_s)
            self._ou = self._ou * keep + self._rng.gauss(0.0, j * math.sqrt(1.0 - keep * keep))
            self._ou_at_s = now_s
            offset = self._ou
        elif dist == "normal":
            offset = self._rng.gauss(0.0, j)
        elif dist == "uniform":
            offset = self._rng.uniform(-j, j)
        else:  # pareto: heavy tail to the right, zero mean
            offset = j * (self._rng.paretovariate(3.0) - 1.5)
        return max(0.0, self._delay_s + offset)

    def admit(self, now_s: float, segments: int, wire_bytes: int, cut: bool) -> list[Delivery]:
        """The fate of a burst arriving at ``now_s``; ``cut``: the link is partitioned now."""
        st = self.stats
        st.packets_in += segments
        st.bytes_in += wire_bytes
        if cut:
            st.dropped_outage += segments
            return []
        if self.transparent:
            st.delivered += segments
            return [Delivery(0, segments, now_s)]
        fit, leave_s = self._admit_queue(now_s, segments, wire_bytes)
        st.dropped_queue += segments - fit
        if fit == 0:
            return []
        at_s = leave_s + self._delay(now_s)
        if not self.spec.jitter_reorders:
            at_s = max(at_s, self._last_at_s)
            self._last_at_s = at_s
        return self._fates(fit, at_s)

    def _fates(self, n: int, at_s: float) -> list[Delivery]:
        st = self.stats
        lost = set(self._loss.take(n))
        if self._ge is not None:
            lost.update(self._ge.take(n))
        special: dict[int, str] = dict.fromkeys(lost, "lost")
        for kind, gaps in (("reorder", self._reorder), ("corrupt", self._corrupt), ("dup", self._duplicate)):
            for i in gaps.take(n):
                special.setdefault(i, kind)
        if not special:
            st.delivered += n
            return [Delivery(0, n, at_s)]
        out: list[Delivery] = []
        start = 0
        for i in sorted(special):
            if i > start:
                out.append(Delivery(start, i - start, at_s))
            kind = special[i]
            if kind == "lost":
                st.dropped_loss += 1
            elif kind == "reorder":
                st.reordered += 1
                out.append(Delivery(i, 1, at_s - self._advance_s))
            elif kind == "corrupt":
                st.corrupted += 1
                out.append(Delivery(i, 1, at_s, corrupt=True))
            else:
                st.duplicated += 1
                out += [Delivery(i, 1, at_s), Delivery(i, 1, at_s)]
            start = i + 1
        if start < n:
            out.append(Delivery(start, n - start, at_s))
        st.delivered += n - len(lost)
        return out


class LinkModel:
    """Both directions, the scheduled outages (relative to ``start_s``) and a manual outage switch."""

    def __init__(self, profile: Profile, start_s: float) -> None:
        self.start_s = start_s
        self.cut_until_s = dict.fromkeys(DIRECTIONS, -math.inf)  # manual outages, per direction
        self.set_profile(profile)

    def set_profile(self, profile: Profile) -> None:
        self.profile = profile
        self.directions = {d: DirectionModel(profile.direction(d), d, profile.seed) for d in DIRECTIONS}
        self._outages: tuple[Outage, ...] = profile.outages

    def is_cut(self, direction: str, now_s: float) -> bool:
        if now_s < self.cut_until_s[direction]:
            return True
        t = now_s - self.start_s
        return any(o.covers(direction, t) for o in self._outages)

    def admit(self, direction: str, now_s: float, segments: int, wire_bytes: int) -> list[Delivery]:
        cut = self.is_cut(direction, now_s)
        return self.directions[direction].admit(now_s, segments, wire_bytes, cut)

    def set_outage(self, now_s: float, seconds: float | None, direction: str = "both") -> None:
        """Cut ``direction`` (or both) for ``seconds`` from now (None: until ``clear_outage``)."""
        until = math.inf if seconds is None else now_s + seconds
        for d in _directions(direction):
            self.cut_until_s[d] = until

    def clear_outage(self, direction: str = "both") -> None:
        for d in _directions(direction):
            self.cut_until_s[d] = -math.inf

    def manual_left_s(self, now_s: float) -> float:
        """How long the longest manual outage still lasts (0: none; inf: until cleared)."""
        return max(0.0, *(until - now_s for until in self.cut_until_s.values()))

    def stats(self) -> dict[str, dict[str, int]]:
        return {d: m.stats.as_dict() for d, m in self.directions.items()}


def _directions(direction: str) -> tuple[str, ...]:
    if direction == "both":
        return DIRECTIONS
    if direction not in DIRECTIONS:
        raise InvalidInput(f"direction {direction!r}: use 'both', 'a_to_b' or 'b_to_a'")
    return (direction,)


__all__ = ["Delivery", "DirectionModel", "DirectionStats", "EventGaps", "LinkModel"]
