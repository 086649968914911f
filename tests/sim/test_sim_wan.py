"""The simulated WAN line against hand-computed schedules, and the pool's invariants."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.errors import ConfigError
from pddlink.sim.resources import Clock
from pddlink.sim.wan import LineStats, WanLine


def _collect() -> tuple[dict[Any, float], Any]:
    done: dict[Any, float] = {}

    def cb(t: float, arg: Any) -> None:
        done[arg] = t

    return done, cb


@pytest.mark.parametrize("fifo", [False, True])
def test_fair_share_finishes_small_flow_first(fifo: bool) -> None:
    clock = Clock()
    line = WanLine(clock, rate_bytes_s=100.0, rtt_s=0.0, pool_size=8, flow_cap_bytes_s=1e9, fifo=fifo)
    done, cb = _collect()
    line.send(100, 0.0, cb, "a")
    line.send(300, 0.0, cb, "b")
    clock.run()
    # Two flows at 50 B/s: a done at 2 s (100 B); b has 200 B left alone at 100 B/s: 4 s.
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(4.0)
    assert line.stats(4.0).delivered_bytes == pytest.approx(400)


def test_multiplexed_pool_shares_the_connections_caps() -> None:
    clock = Clock()
    line = WanLine(clock, rate_bytes_s=100.0, rtt_s=0.2, pool_size=2, flow_cap_bytes_s=10.0)
    done, cb = _collect()
    for name in "abc":
        line.send(20, 0.0, cb, name)
    clock.run()
    # Three flows on a pool of two 10 B/s connections: 20 B/s shared by three; then +rtt/2.
    assert all(t == pytest.approx(3.0 + 0.1) for t in done.values())
    s = line.stats(3.0)
    assert s.pool_full_s == pytest.approx(3.0) and s.held_s == pytest.approx(6.0)
    assert s.flows_s == pytest.approx(9.0) and s.wait_s == 0.0


def test_fifo_pool_holds_one_connection_per_transfer_and_queues_the_rest() -> None:
    clock = Clock()
    line = WanLine(clock, rate_bytes_s=100.0, rtt_s=0.2, pool_size=2, flow_cap_bytes_s=10.0, fifo=True)
    done, cb = _collect()
    for name in "abc":
        line.send(20, 0.0, cb, name)
    assert line.sending == 2 and line.waiting == 1
    clock.run()
    # a and b at 10 B/s each: 2 s; c waits for one of their connections, then 2 s alone at its cap.
    assert done["a"] == done["b"] == pytest.approx(2.1) and done["c"] == pytest.approx(4.1)
    s = line.stats(4.0)
    assert s.wait_s == pytest.approx(2.0) and s.pool_full_s == pytest.approx(2.0)
    assert s.held_s == pytest.approx(6.0) and s.transfers == 3


@pytest.mark.parametrize("fifo", [False, True])
def test_a_small_transfer_behind_a_large_one(fifo: bool) -> None:
    clock = Clock()
    line = WanLine(clock, rate_bytes_s=100.0, rtt_s=0.0, pool_size=1, flow_cap_bytes_s=100.0, fifo=fifo)
    done, cb = _collect()
    line.send(1000, 0.0, cb, "large")
    line.send(10, 0.0, cb, "small")
    clock.run()
    # Multiplexed, the two share the line (small done at 0.2 s); FIFO, small waits for the pool.
    assert done["small"] == pytest.approx(10.1 if fifo else 0.2)
    assert done["large"] == pytest.approx(10.0 if fifo else 10.1)


def test_estimate_sees_backlog_and_fifo_waits() -> None:
    clock = Clock()
    line = WanLine(clock, rate_bytes_s=100.0, rtt_s=0.0, pool_size=8, flow_cap_bytes_s=1e9)
    _, cb = _collect()
    line.send(1000, 0.0, cb, "a")
    est = line.estimate(5.0)
    assert est.flows_in_flight == 1 and est.backlog_bytes == 500
    assert est.transfer_s(100) == pytest.approx(2.0)
    fifo = WanLine(Clock(), rate_bytes_s=100.0, rtt_s=0.0, pool_size=1, flow_cap_bytes_s=100.0, fifo=True)
    fifo.send(1000, 0.0, cb, "a")
    fifo.send(1000, 0.0, cb, "b")
    est = fifo.estimate(0.0)
    assert est.flows_in_flight == 2 and est.pool_size == 1 and est.backlog_bytes == 2000
    assert est.pool_wait_s() > 0  # the router is told that a new transfer would wait


def test_stats_subtract_to_a_window() -> None:
    a = LineStats(delivered_bytes=10.0, busy_s=2.0, transfers=3)
    b = LineStats(delivered_bytes=25.0, busy_s=5.0, transfers=4)
    assert b - a == LineStats(delivered_bytes=15.0, busy_s=3.0, transfers=1)


def test_bad_line_is_refused() -> None:
    with pytest.raises(ConfigError):
        WanLine(Clock(), rate_bytes_s=100.0, rtt_s=0.0, pool_size=0, flow_cap_bytes_s=1.0)


@settings(max_examples=60, deadline=None)
@given(
    pool=st.integers(1, 6),
    fifo=st.booleans(),
    sends=st.lists(st.tuples(st.floats(0, 5), st.integers(1, 500)), min_size=1, max_size=30),
)
def test_every_byte_arrives_and_a_fifo_pool_never_oversubscribes(
    pool: int, fifo: bool, sends: list[tuple[float, int]]
) -> None:
    clock = Clock()
    line = WanLine(clock, rate_bytes_s=100.0, rtt_s=0.01, pool_size=pool, flow_cap_bytes_s=30.0, fifo=fifo)
    done: dict[int, float] = {}
    sent_at: dict[int, float] = {}

    def finished(t: float, i: int) -> None:
        done[i] = t
        assert not fifo or line.sending <= pool

    def start(now: float, item: tuple[int, int]) -> None:
        line.send(item[1], now, finished, item[0])
        assert not fifo or line.sending <= pool

    for i, (t, nbytes) in enumerate(sorted(sends)):
        sent_at[i] = t
        clock.at(t, start, (i, nbytes))
    clock.run()
    assert sorted(done) == list(range(len(sends)))
    total = sum(n for _, n in sends)
    assert line.stats(clock.now).delivered_bytes == pytest.approx(total, abs=len(sends))
    for i, (_, nbytes) in enumerate(sorted(sends)):
        # never faster than one connection's cap (the line settles a transfer within a byte of its
        # end, so a transfer may finish one byte's time early)
        assert done[i] - sent_at[i] >= (nbytes - 1) / 30.0
    s = line.stats(clock.now)
    assert s.held_s <= pool * s.busy_s + 1e-9 and s.pool_full_s <= s.busy_s + 1e-9
