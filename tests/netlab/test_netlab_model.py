"""The link model with an injected clock: statistics against the profile, seeded and deterministic."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netlab.model import DirectionModel, EventGaps, LinkModel
from netlab.profile import DirectionSpec, GilbertElliott, Outage, Profile
from pddlink.errors import InvalidInput


def one_way(**kw: object) -> DirectionModel:
    return DirectionModel(DirectionSpec(**kw), "a_to_b", seed=7)  # type: ignore[arg-type]


def feed(model: DirectionModel, n: int, gap_s: float = 1e-4, size: int = 1500) -> list[tuple[float, float]]:
    """(sent, arrived) per delivered single-packet burst."""
    out = []
    for i in range(n):
        now = i * gap_s
        out += [(now, d.at_s) for d in model.admit(now, 1, size, cut=False)]
    return out


@given(p=st.floats(0.001, 0.9), seed=st.integers(0, 1000), cuts=st.lists(st.integers(1, 50), max_size=20))
@settings(max_examples=50, deadline=None)
def test_event_gaps_do_not_depend_on_how_packets_are_grouped(p: float, seed: int, cuts: list[int]) -> None:
    whole = EventGaps(p, random.Random(seed)).take(sum(cuts))
    chunked, gaps, base = [], EventGaps(p, random.Random(seed)), 0
    for n in cuts:
        chunked += [base + i for i in gaps.take(n)]
        base += n
    assert chunked == whole


@pytest.mark.parametrize("p", [0.001, 0.01, 0.2])
def test_random_loss_rate_within_three_standard_errors(p: float) -> None:
    m = one_way(loss=p)
    n = 200_000
    for i in range(0, n, 40):  # bursts of 40 segments, as super-packets arrive
        m.admit(i * 1e-6, 40, 60_000, cut=False)
    se = math.sqrt(p * (1 - p) / n)
    assert abs(m.stats.dropped_loss / n - p) <= 3 * se


def test_gilbert_elliott_mean_loss_and_burst_length() -> None:
    ge = GilbertElliott(p=0.01, r=0.25, loss_good=0.0, loss_bad=1.0)
    m = one_way(gilbert_elliott=ge)
    lost = []
    for i in range(100_000):
        lost.append(not m.admit(i * 1e-6, 1, 1500, cut=False))
    rate = sum(lost) / len(lost)
    assert abs(rate - ge.mean_loss) < 0.15 * ge.mean_loss
    bursts, run = [], 0
    for x in [*lost, False]:
        if x:
            run += 1
        elif run:
            bursts.append(run)
            run = 0
    assert abs(sum(bursts) / len(bursts) - 1 / ge.r) < 0.5  # mean burst ~ 1/r = 4 packets


@pytest.mark.parametrize("gap_s", [1e-5, 1e-3])
def test_correlated_jitter_keeps_order_and_mean_delay(gap_s: float) -> None:
    m = one_way(delay_ms=20.0, jitter_ms=2.0, distribution="normal", jitter_correlation_ms=10.0)
    pairs = feed(m, 60_000, gap_s=gap_s)
    delays = [a - s for s, a in pairs]
    mean = sum(delays) / len(delays)
    std = math.sqrt(sum((d - mean) ** 2 for d in delays) / len(delays))
    assert abs(mean - 0.020) < 0.0005  # the order constraint barely biases a drifting delay
    assert 0.0010 < std < 0.0030
    arrivals = [a for _, a in pairs]
    assert arrivals == sorted(arrivals)  # jitter_reorders = false


def test_uncorrelated_jitter_statistics() -> None:
    m = one_way(delay_ms=20.0, jitter_ms=2.0, distribution="uniform", jitter_reorders=True)
    delays = [a - s for s, a in feed(m, 20_000, gap_s=1e-3)]
    assert abs(sum(delays) / len(delays) - 0.020) < 0.0001
    assert min(delays) >= 0.018 and max(delays) <= 0.022


def test_jitter_may_reorder_when_asked() -> None:
    m = one_way(delay_ms=20.0, jitter_ms=5.0, distribution="uniform", jitter_reorders=True)
    arrivals = [a for _, a in feed(m, 2000, gap_s=1e-4)]
    assert arrivals != sorted(arrivals)


def test_rate_serializes_bytes_and_queue_limit_drops_the_tail() -> None:
    m = one_way(rate_mbit=100.0, queue_packets=50)
    # 1000 packets of 1250 bytes offered at once: 50 fit, each takes 100 us at 100 Mbit/s
    fates = [m.admit(0.0, 1, 1250, cut=False) for _ in range(1000)]
    kept = [f[0].at_s for f in fates if f]
    assert len(kept) == 50 and m.stats.dropped_queue == 950
    assert kept[-1] == pytest.approx(50 * 1250 * 8 / 100e6)
    # a super-packet larger than the room left is cut: its leading segments fit
    m2 = one_way(rate_mbit=100.0, queue_packets=30)
    m2.admit(0.0, 20, 30_000, cut=False)
    fate = m2.admit(0.0, 20, 30_000, cut=False)
    assert [(d.first, d.count) for d in fate] == [(0, 10)]


def test_offered_load_above_rate_is_delivered_at_the_rate() -> None:
    m = one_way(rate_mbit=200.0, queue_packets=1000)
    delivered_bytes, last = 0, 0.0
    for i in range(100_000):  # 1500 B every 30 us = 400 Mbit/s offered
        for d in m.admit(i * 30e-6, 1, 1500, cut=False):
            delivered_bytes += 1500
            last = d.at_s
    assert delivered_bytes * 8 / last / 1e6 == pytest.approx(200.0, rel=0.01)


def test_reorder_duplicate_corrupt_counts() -> None:
    m = one_way(delay_ms=10.0, reorder=0.01, duplicate=0.02, corrupt=0.005)
    n = 100_000
    sent = [(i * 1e-5, d) for i in range(n) for d in m.admit(i * 1e-5, 1, 1500, cut=False)]
    deliveries = [d for _, d in sent]
    st_ = m.stats
    for count, p in ((st_.reordered, 0.01), (st_.duplicated, 0.02), (st_.corrupted, 0.005)):
        assert abs(count / n - p) <= 4 * math.sqrt(p / n)
    assert sum(d.corrupt for d in deliveries) == st_.corrupted
    early = [d for t, d in sent if d.at_s - t < 0.001]
    assert len(early) == st_.reordered  # sent ahead, without the delay


def test_seeded_models_replay_identically_and_seeds_differ() -> None:
    prof = Profile(DirectionSpec(delay_ms=5, jitter_ms=1, loss=0.05), DirectionSpec(loss=0.05), seed=3)

    def run(p: Profile) -> list[object]:
        m = LinkModel(p, 0.0)
        return [m.admit("a_to_b", i * 1e-4, 3, 4500) for i in range(3000)]

    assert run(prof) == run(prof)
    other = Profile(prof.a_to_b, prof.b_to_a, seed=4)
    assert run(prof) != run(other)


def test_scheduled_and_manual_outages() -> None:
    prof = Profile(DirectionSpec(), DirectionSpec(), outages=(Outage(1.0, 0.5, "a_to_b"),))
    m = LinkModel(prof, start_s=100.0)
    assert m.admit("a_to_b", 100.9, 1, 100)
    assert not m.admit("a_to_b", 101.2, 1, 100)
    assert m.admit("b_to_a", 101.2, 1, 100)  # the other direction still works
    assert m.admit("a_to_b", 101.5, 1, 100)
    m.set_outage(102.0, 3.0)
    assert not m.admit("b_to_a", 104.9, 1, 100) and m.admit("b_to_a", 105.0, 1, 100)
    m.set_outage(106.0, None)
    assert not m.admit("a_to_b", 1e6, 1, 100)
    m.clear_outage()
    assert m.admit("a_to_b", 1e6, 1, 100)
    assert m.stats()["a_to_b"]["dropped_outage"] == 2
    m.set_outage(2e6, 1.0, "b_to_a")  # a one-way cut
    assert m.admit("a_to_b", 2e6, 1, 100) and not m.admit("b_to_a", 2e6, 1, 100)
    assert m.manual_left_s(2e6) == 1.0
    with pytest.raises(InvalidInput):
        m.set_outage(0.0, 1.0, "sideways")
