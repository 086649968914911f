"""Mirror behind a lossy event stream: it is always an exact past state, and converges after resync."""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import given, settings

from pddlink.drc import (
    BlocksRemoved,
    BlocksStored,
    Event,
    Mirror,
    PrefixIndex,
    decode_event,
    decode_snapshot,
    encode_event,
    encode_snapshot,
)
from pddlink.kv.hashing import BlockHasher

HASHER = BlockHasher("mirror-test", block_size=1)


def random_prompt(rng: random.Random) -> list[int]:
    return HASHER.hash_blocks([rng.randrange(3) for _ in range(rng.randrange(1, 8))])


def resync(mirror: Mirror, index: PrefixIndex, now: float) -> None:
    assert mirror.load_snapshot(decode_snapshot(encode_snapshot(index)), now)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    drop=st.sampled_from([0.0, 0.05, 0.3]),
    dup=st.sampled_from([0.0, 0.2]),
    clear_at=st.integers(0, 120),
)
def test_lossy_stream_converges_and_is_always_a_past_state(
    seed: int, drop: float, dup: float, clear_at: int
) -> None:
    rng = random.Random(seed)
    index = PrefixIndex(capacity_blocks=25, epoch=7)
    mirror = Mirror(gap_timeout_s=0.5)
    history = {0: frozenset()}
    in_flight: list[bytes] = []
    now = 0.0
    for step in range(150):
        now += 0.05
        events: list[Event] = index.clear(now) if step == clear_at else index.insert(random_prompt(rng), now)
        for ev in events:
            state = set(history[ev.seq - 1])
            if isinstance(ev, BlocksStored):
                state.update(ev.hashes)
            elif isinstance(ev, BlocksRemoved):
                state.difference_update(ev.hashes)
            else:
                state.clear()
            history[ev.seq] = frozenset(state)
            if rng.random() >= drop:
                in_flight.extend([encode_event(ev)] * (2 if rng.random() < dup else 1))
        assert history[index.seq] == {h for h, _ in index.blocks()}  # events describe the index
        rng.shuffle(in_flight)  # reorder
        for _ in range(rng.randrange(len(in_flight) + 1)):
            mirror.apply(decode_event(in_flight.pop()), now)
            assert mirror.blocks() == history[mirror.applied_seq]
        if step % 10 == 0:
            mirror.observe_head(index.epoch, index.seq, now)
        if mirror.needs_resync:
            resync(mirror, index, now)
    for data in in_flight:
        mirror.apply(decode_event(data), now)
    mirror.observe_head(index.epoch, index.seq, now)
    mirror.handle_timer(now + 1.0)
    if mirror.needs_resync:
        resync(mirror, index, now + 1.0)
    assert mirror.applied_seq == index.seq
    assert mirror.blocks() == {h for h, _ in index.blocks()}
    assert not mirror.staleness(now + 1.0).needs_resync
    if drop == 0.0 and clear_at >= 150:
        assert mirror.resyncs == 0  # reordering alone never needs a snapshot


def test_reordered_events_wait_for_the_missing_one() -> None:
    index = PrefixIndex(epoch=1)
    events = [ev for prompt in ([0, 1], [0, 2], [1]) for ev in index.insert(HASHER.hash_blocks(prompt), 0.0)]
    mirror = Mirror(gap_timeout_s=1.0)
    mirror.apply(events[0], 0.0)
    mirror.apply(events[2], 0.1)
    stale = mirror.staleness(0.5)
    assert (stale.applied_seq, stale.known_seq, stale.seq_lag, stale.needs_resync) == (1, 3, 2, False)
    assert mirror.get_timer() == 1.1
    mirror.apply(events[1], 0.6)
    assert mirror.applied_seq == 3 and mirror.blocks() == {h for h, _ in index.blocks()}
    assert mirror.get_timer() is None


def test_lost_tail_is_found_by_the_heartbeat_and_a_gap_asks_for_a_snapshot() -> None:
    index = PrefixIndex(epoch=1)
    (first,) = index.insert(HASHER.hash_blocks([0, 1]), 0.0)
    index.insert(HASHER.hash_blocks([2]), 0.0)  # lost
    mirror = Mirror(gap_timeout_s=1.0)
    mirror.apply(first, 0.0)
    mirror.observe_head(1, index.seq, 0.2)
    assert not mirror.needs_resync and mirror.staleness(0.2).seq_lag == 1
    assert mirror.staleness(1.2).needs_resync
    resync(mirror, index, 1.3)
    stale = mirror.staleness(2.0)
    assert stale.seq_lag == 0 and stale.since_update_s == 0.7 and not stale.needs_resync


def test_new_epoch_leaves_no_stale_entries() -> None:
    old = PrefixIndex(epoch=100)
    old_events = [ev for p in ([0, 0], [1, 1]) for ev in old.insert(HASHER.hash_blocks(p), 0.0)]
    mirror = Mirror(gap_timeout_s=1.0)
    for ev in old_events[:1]:
        mirror.apply(ev, 0.0)
    old_snapshot = decode_snapshot(encode_snapshot(old))

    new = PrefixIndex(epoch=200)  # MD restarted: a new, empty life
    (first,) = new.insert(HASHER.hash_blocks([2, 2]), 1.0)
    (second,) = new.insert(HASHER.hash_blocks([0]), 1.0)  # a block the old life also had
    mirror.apply(second, 1.0)  # arrives before `first`: the old life is dropped at once
    assert len(mirror) == 0 and mirror.epoch == 200 and mirror.resets == 2
    mirror.apply(old_events[1], 1.1)  # delayed event of the old life
    assert not mirror.load_snapshot(old_snapshot, 1.1)  # and an old snapshot: both ignored
    mirror.apply(first, 1.2)
    assert mirror.blocks() == {h for h, _ in new.blocks()}
    assert mirror.match(HASHER.hash_blocks([1, 1])).matched_blocks == 0
    assert mirror.match(HASHER.hash_blocks([0, 0])).matched_blocks == 1


def test_joining_midway_asks_for_a_snapshot_at_once() -> None:
    index = PrefixIndex(epoch=5)
    for p in ([0], [1], [2]):
        (last,) = index.insert(HASHER.hash_blocks(p), 0.0)
    mirror = Mirror()
    assert isinstance(last, BlocksStored)
    mirror.apply(last, 0.0)
    assert mirror.needs_resync and len(mirror) == 0
    resync(mirror, index, 0.1)
    assert mirror.blocks() == {h for h, _ in index.blocks()} and not mirror.needs_resync
