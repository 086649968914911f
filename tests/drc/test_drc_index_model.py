"""PrefixIndex against a brute-force model: every cached prefix held as a tuple, LRU by full scans,
reservations with leases that run out as (injected) time passes.

The model touches every block of a used path eagerly and evicts, one block at a time, the unpinned
leaf used least recently; the index's lazy recency must give exactly the same contents. A mirror fed
every event must hold exactly the index's blocks after every step.
"""

from __future__ import annotations

from functools import cache

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pddlink.drc import BlocksRemoved, BlocksStored, Mirror, PrefixIndex, RefusalReason, ReservationRefused
from pddlink.errors import InvalidInput, NotFound
from pddlink.kv.hashing import BlockHasher

HASHER = BlockHasher("model-test", block_size=1)
Prefix = tuple[int, ...]
sequences = st.lists(st.integers(0, 1), max_size=5).map(tuple)


@cache
def block_hash(prefix: Prefix) -> int:
    return HASHER.hash_blocks(list(prefix))[-1]


def chain(seq: Prefix) -> list[int]:
    return [block_hash(seq[: i + 1]) for i in range(len(seq))]


class CacheModel:
    """Brute force: a set of prefixes with last-use ticks and pin counts."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.last_use: dict[Prefix, int] = {}
        self.pins: dict[Prefix, int] = {}
        self.tick = 0
        self.hit_blocks = 0

    def matched(self, seq: Prefix) -> int:
        k = 0
        while k < len(seq) and seq[: k + 1] in self.last_use:
            k += 1
        return k

    def touch(self, seq: Prefix, upto: int) -> None:
        self.tick += 1
        for i in range(1, upto + 1):
            self.last_use[seq[:i]] = self.tick

    def protected(self, p: Prefix, extra: Prefix | None) -> bool:
        """Pinned, or an ancestor of a pinned block (or of ``extra``)."""
        pins = [q for q, n in self.pins.items() if n > 0] + ([extra] if extra else [])
        return any(q[: len(p)] == p for q in pins)

    def evict_one(self, protect: Prefix | None) -> Prefix | None:
        leaves = [
            p
            for p in self.last_use
            if not any(c[:-1] == p for c in self.last_use) and not self.protected(p, protect)
        ]
        if not leaves:
            return None
        victim = min(leaves, key=lambda p: self.last_use[p])
        ticks = [self.last_use[p] for p in leaves]
        assert ticks.count(self.last_use[victim]) == 1, "two LRU leaves share a tick"
        del self.last_use[victim]
        return victim

    def insert(self, seq: Prefix) -> list[Prefix]:
        k = self.matched(seq)
        evicted: list[Prefix] = []
        room = len(seq) - k
        if self.capacity is not None and room:
            over = len(self.last_use) + room - self.capacity
            while over > 0 and (victim := self.evict_one(seq[:k] or None)) is not None:
                evicted.append(victim)
                over -= 1
            room = min(room, self.capacity - len(self.last_use))
        self.touch(seq, k + room)  # adds the new blocks too
        return evicted


class IndexMachine(RuleBasedStateMachine):
    @initialize(capacity=st.one_of(st.none(), st.integers(1, 6)))
    def start(self, capacity: int | None) -> None:
        self.index = PrefixIndex(capacity, epoch=3)
        self.model = CacheModel(capacity)
        self.mirror = Mirror()
        self.now = 0.0
        self.pinned: list[Prefix] = []
        self.leases: dict[str, tuple[Prefix, Prefix | None, float]] = {}  # id -> (seq, tip, expiry)
        self.ended: dict[str, RefusalReason] = {}
        self.reserved = 0

    def expire(self) -> set[str]:
        """The model's side of every index call that takes ``now``: overdue leases end first."""
        gone = {rid for rid, (_, _, expiry) in self.leases.items() if expiry <= self.now}
        for rid in gone:
            tip = self.leases.pop(rid)[1]
            self.ended[rid] = RefusalReason.EXPIRED
            if tip:
                self.model.pins[tip] -= 1
        return gone

    def feed(self, events: list[object]) -> list[int]:
        removed: list[int] = []
        for ev in events:
            assert isinstance(ev, BlocksStored | BlocksRemoved)
            if isinstance(ev, BlocksRemoved):
                removed.extend(ev.hashes)
            self.mirror.apply(ev, self.now)
        return removed

    @rule(seq=sequences)
    def insert(self, seq: Prefix) -> None:
        self.now += 1
        self.expire()
        evicted = self.model.insert(seq)
        removed = self.feed(list(self.index.insert(chain(seq), self.now)))
        assert removed == [block_hash(p) for p in evicted]

    @rule(seq=sequences)
    def access(self, seq: Prefix) -> None:
        self.expire()
        k = self.model.matched(seq)
        self.model.hit_blocks += k
        if k:
            self.model.touch(seq, k)
        assert self.index.access(chain(seq), self.now).matched_blocks == k

    @rule(seq=sequences)
    def match(self, seq: Prefix) -> None:
        found = self.index.match(chain(seq))
        k = self.model.matched(seq)
        assert found.matched_blocks == k
        assert found.tip == (block_hash(seq[:k]) if k else None)
        assert self.mirror.match(chain(seq)) == found

    @rule(n=st.integers(0, 3))
    def evict(self, n: int) -> None:
        self.expire()
        evicted = []
        for _ in range(n):
            victim = self.model.evict_one(None)
            if victim is None:
                break
            evicted.append(victim)
        removed = self.feed(list(self.index.evict(n, self.now)))
        assert removed == [block_hash(p) for p in evicted]

    @precondition(lambda self: bool(self.model.last_use))
    @rule(data=st.data())
    def engine_drops(self, data: st.DataObject) -> None:
        """The engine's pool ran short and dropped blocks on its own: the index forgets them and
        everything below them; a reservation whose prefix went ends (reason: evicted)."""
        self.expire()
        cached = sorted(self.model.last_use)
        dropped = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=3))
        gone = {p for p in cached if any(p[: len(d)] == d for d in dropped)}
        for p in gone:
            del self.model.last_use[p]
            self.model.pins.pop(p, None)
        self.pinned = [p for p in self.pinned if p not in gone]
        for rid, (_, tip, _) in list(self.leases.items()):
            if tip in gone:
                del self.leases[rid]
                self.ended[rid] = RefusalReason.EVICTED
        stale = block_hash((2,))  # never cached (tokens are 0/1): ignored
        events = list(self.index.forget([block_hash(d) for d in dropped] + [stale], self.now))
        removed = self.feed(events)
        assert set(removed) == {block_hash(p) for p in gone} and len(removed) == len(gone)
        position = {h: i for i, h in enumerate(removed)}
        for p in gone:  # children before parents, so a mirror never holds an orphan
            if len(p) > 1 and p[:-1] in gone:
                assert position[block_hash(p)] < position[block_hash(p[:-1])]

    @rule(seq=sequences)
    def pin(self, seq: Prefix) -> None:
        k = self.model.matched(seq)
        if k == 0:
            if seq:
                with pytest.raises(NotFound):
                    self.index.pin(block_hash(seq))
            return
        self.index.pin(block_hash(seq[:k]))
        self.model.pins[seq[:k]] = self.model.pins.get(seq[:k], 0) + 1
        self.pinned.append(seq[:k])

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        p = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self.index.unpin(block_hash(p))
        self.model.pins[p] -= 1
        if self.model.pins[p] == 0:
            with pytest.raises(InvalidInput):
                self.index.unpin(block_hash(p))

    @rule(seq=sequences, lease_s=st.sampled_from([0.5, 1.5, 3.0]))
    def reserve(self, seq: Prefix, lease_s: float) -> None:
        self.expire()
        rid = f"r{self.reserved}"
        self.reserved += 1
        k = self.model.matched(seq)
        self.model.hit_blocks += k
        if k:
            self.model.touch(seq, k)
            self.model.pins[seq[:k]] = self.model.pins.get(seq[:k], 0) + 1
        held = self.index.reserve(rid, chain(seq), lease_s, self.now)
        assert held.cached_blocks == k and held.expires_at_s == self.now + lease_s
        self.leases[rid] = (seq, seq[:k] or None, self.now + lease_s)

    @rule(dt_s=st.sampled_from([0.25, 1.0]))
    def time_passes(self, dt_s: float) -> None:
        self.now += dt_s
        assert set(self.index.handle_timer(self.now)) == self.expire()
        expiries = [expiry for _, _, expiry in self.leases.values()]
        assert self.index.get_timer() == (min(expiries) if expiries else None)

    @precondition(lambda self: bool(self.leases) or bool(self.ended))
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(set(self.leases) | set(self.ended))))
        self.expire()
        if rid not in self.leases:
            with pytest.raises(ReservationRefused) as info:
                self.index.release(rid, self.now)
            assert info.value.reason is self.ended[rid]
            return
        seq, tip, _ = self.leases.pop(rid)
        if commit:
            evicted = self.model.insert(seq)  # the reserved prefix is still pinned meanwhile
            removed = self.feed(list(self.index.commit(rid, chain(seq), self.now)))
            assert removed == [block_hash(p) for p in evicted]
        else:
            self.index.release(rid, self.now)
        if tip:
            self.model.pins[tip] -= 1
        self.ended[rid] = RefusalReason.UNKNOWN  # a finished reservation is forgotten

    @invariant()
    def same_contents(self) -> None:
        expected = {block_hash(p) for p in self.model.last_use}
        assert {h for h, _ in self.index.blocks()} == expected
        assert self.mirror.blocks() == expected
        stats = self.index.stats()
        assert stats.cached_blocks == len(expected)
        assert stats.hit_blocks == self.model.hit_blocks
        if self.model.capacity is not None:
            assert len(self.index) <= self.model.capacity

    @invariant()
    def pinned_blocks_stay(self) -> None:
        assert self.index.stats().reservations == len(self.leases)
        for p in self.pinned + [tip for _, tip, _ in self.leases.values() if tip]:
            assert block_hash(p) in self.index
            assert self.index.pin_count(block_hash(p)) >= 1


IndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexAgainstModel = IndexMachine.TestCase
