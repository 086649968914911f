"""``ConnSlots``: whose connection slot goes when the caps are reached (sans-I/O, injected time)."""

from __future__ import annotations

from pddlink.serving.conn_slots import ConnSlots, Phase, SlotRefusal


def test_the_total_cap_closes_the_oldest_headless_then_the_oldest_idle_then_refuses() -> None:
    s = ConnSlots(max_total=3, max_per_owner=10)
    assert (
        s.open(1, "addr:a", 0.0) == () and s.open(2, "addr:b", 1.0) == () and s.open(3, "addr:c", 2.0) == ()
    )
    assert s.headed(1, "key:k", 3.0) is None  # 1 is busy now: 2 is the oldest head-less
    assert s.open(4, "addr:d", 4.0) == (2,)
    assert s.open(5, "addr:d", 5.0) == (3,)
    s.idle(1, 6.0)
    assert s.headed(4, "addr:d", 6.5) is None and s.headed(5, "addr:d", 6.6) is None
    assert s.open(6, "addr:e", 7.0) == (1,)  # no head-less left: the idle one goes
    assert s.headed(6, "addr:e", 7.5) is None
    got = s.open(7, "addr:f", 8.0)
    assert isinstance(got, SlotRefusal) and got.status == 503  # every one busy: refused
    assert len(s) == 3 and 7 not in s.slots


def test_strangers_on_a_keyed_clients_address_cannot_lock_it_out() -> None:
    s = ConnSlots(max_total=100, max_per_owner=2)
    assert s.open(1, "addr:a", 0.0) == () and s.open(2, "addr:a", 1.0) == ()
    assert s.open(3, "addr:a", 2.0) == (1,)  # the address is at its cap: its oldest head-less goes
    assert s.headed(3, "key:k", 2.1) is None  # counted against its key from now on
    assert s.counts == {"addr:a": 1, "key:k": 1}
    assert s.open(4, "addr:a", 3.0) == ()
    assert s.headed(4, "key:k", 3.1) is None
    assert s.open(5, "addr:a", 4.0) == ()
    refused = s.headed(5, "key:k", 4.1)  # the key's own cap holds
    assert isinstance(refused, SlotRefusal) and refused.status == 429
    s.close(5)
    assert s.counts == {"addr:a": 1, "key:k": 2}


def test_busy_connections_of_one_address_are_not_evicted_for_its_next() -> None:
    s = ConnSlots(max_total=100, max_per_owner=2)
    for c in (1, 2):
        assert s.open(c, "addr:a", float(c)) == () and s.headed(c, "addr:a", float(c)) is None
    got = s.open(3, "addr:a", 3.0)
    assert isinstance(got, SlotRefusal) and got.status == 429
    assert s.phase(1) is Phase.ACTIVE and s.counts == {"addr:a": 2}


def test_close_is_idempotent_and_counts_return_to_zero() -> None:
    s = ConnSlots(max_total=2, max_per_owner=2)
    s.open(1, "addr:a", 0.0)
    s.close(1)
    s.close(1)
    assert len(s) == 0 and s.counts == {}
