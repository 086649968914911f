"""Reservations: the matched prefix is pinned under a lease; stale or unknown ones are refused."""

from __future__ import annotations

import pytest

from pddlink.drc import PrefixIndex, RefusalReason, ReservationRefused
from pddlink.errors import ErrorCode, InvalidInput
from pddlink.kv.hashing import BlockHasher

HASHER = BlockHasher("lease-test", block_size=4)
PROMPT = list(range(40))  # 10 blocks
CACHED = HASHER.hash_blocks(PROMPT[:24])  # 6 blocks cached
FULL = HASHER.hash_blocks(PROMPT)


def refusal(call: object, *args: object) -> ReservationRefused:
    with pytest.raises(ReservationRefused) as info:
        call(*args)  # type: ignore[operator]
    return info.value


def make_index(capacity: int = 8) -> PrefixIndex:
    index = PrefixIndex(capacity_blocks=capacity)
    index.insert(CACHED, now=0.0)
    return index


def test_reserve_answers_cached_length_and_protects_it_until_commit() -> None:
    index = make_index()
    held = index.reserve("r1", FULL, lease_s=2.0, now=1.0)
    assert (held.cached_blocks, held.missing_blocks, held.tip) == (6, 4, CACHED[-1])
    assert held.expires_at_s == 3.0 and index.get_timer() == 3.0
    assert index.evict(8, now=1.5) == []  # everything cached is the pinned prefix
    events = index.commit("r1", FULL, now=2.5)  # 4 new blocks: 2 evictions impossible -> 2 fit
    assert index.match(FULL).matched_blocks == 8 and len(index) == 8
    assert sum(len(e.hashes) for e in events) == 2
    assert index.stats().reservations == 0 and index.stats().pinned_blocks == 0
    assert refusal(index.commit, "r1", FULL, 2.6).reason is RefusalReason.UNKNOWN


def test_expired_lease_unpins_and_is_refused_with_its_reason() -> None:
    index = make_index()
    index.reserve("r1", FULL, lease_s=1.0, now=0.0)
    assert index.handle_timer(0.5) == []
    assert index.handle_timer(1.0) == ["r1"]
    assert index.get_timer() is None and index.stats().pinned_blocks == 0
    assert len(index.evict(6, now=1.1)[0].hashes) == 6  # the prefix is evictable again
    err = refusal(index.commit, "r1", FULL, 1.2)
    assert err.reason is RefusalReason.EXPIRED and err.code is ErrorCode.LEASE_EXPIRED
    assert refusal(index.renew, "r1", 1.0, 1.2).reason is RefusalReason.EXPIRED
    assert index.stats().leases_expired == 1 and index.stats().reservations_refused == 2


def test_lease_runs_out_at_any_later_call_even_without_the_timer() -> None:
    index = make_index()
    index.reserve("r1", FULL, lease_s=1.0, now=0.0)
    err = refusal(index.release, "r1", 5.0)
    assert err.reason is RefusalReason.EXPIRED


def test_renew_extends_and_release_drops_the_pin() -> None:
    index = make_index()
    index.reserve("r1", FULL, lease_s=1.0, now=0.0)
    assert index.renew("r1", 3.0, now=0.9).expires_at_s == pytest.approx(3.9)
    assert index.handle_timer(2.0) == []
    index.release("r1", now=2.0)
    assert index.stats().pinned_blocks == 0
    assert refusal(index.release, "r1", 2.1).reason is RefusalReason.UNKNOWN


def test_refusals_change_nothing() -> None:
    index = make_index()
    index.reserve("r1", FULL, lease_s=5.0, now=0.0)
    before = (list(index.blocks()), index.stats())
    assert refusal(index.reserve, "r1", FULL, 1.0, 0.1).reason is RefusalReason.DUPLICATE
    other = HASHER.hash_blocks([9] * 40)
    err = refusal(index.commit, "r1", other, 0.2)
    assert err.reason is RefusalReason.MISMATCH and err.code is ErrorCode.BAD_REQUEST
    err = refusal(index.commit, "nope", FULL, 0.2)
    assert err.reason is RefusalReason.UNKNOWN and err.code is ErrorCode.NOT_FOUND
    with pytest.raises(InvalidInput):
        index.reserve("r2", FULL, lease_s=0.0, now=0.3)
    with pytest.raises(InvalidInput):
        index.reserve("", FULL, lease_s=1.0, now=0.3)
    after = (list(index.blocks()), index.stats())
    assert after[0] == before[0]
    assert after[1].pinned_blocks == 1 and after[1].reservations == 1


def test_reservation_with_nothing_cached_pins_nothing_and_commits() -> None:
    index = PrefixIndex(capacity_blocks=20)
    held = index.reserve("r1", FULL, lease_s=1.0, now=0.0)
    assert held.cached_blocks == 0 and held.tip is None and index.stats().pinned_blocks == 0
    index.commit("r1", FULL, now=0.5)
    assert index.match(FULL).matched_blocks == 10


def test_clear_ends_live_reservations() -> None:
    index = make_index()
    index.reserve("r1", FULL, lease_s=5.0, now=0.0)
    index.clear(now=1.0)
    assert refusal(index.commit, "r1", FULL, 1.5).reason is RefusalReason.CLEARED
    assert index.get_timer() is None
