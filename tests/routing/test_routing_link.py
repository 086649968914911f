"""The link model: fair-share completion estimates and the running model a sender keeps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import ConfigError, InvalidInput, NotFound
from pddlink.routing import LinkEstimate, LinkModel

RATE = 1e9  # bytes/s


def test_idle_line_is_rtt_plus_serialisation() -> None:
    assert LinkEstimate(RATE, 0.02).transfer_s(10**9) == pytest.approx(1.02)
    assert LinkEstimate(RATE, 0.02).transfer_s(0) == pytest.approx(0.02)


def test_fair_share_with_bigger_flows_in_flight() -> None:
    # Three flows, each with more than 1 GB left: a 1 GB flow shares the line four ways.
    est = LinkEstimate(RATE, 0.0, flows_in_flight=3, backlog_bytes=3 * 10**10)
    assert est.transfer_s(10**9) == pytest.approx(4.0)


def test_small_flows_ahead_only_cost_their_backlog() -> None:
    est = LinkEstimate(RATE, 0.0, flows_in_flight=3, backlog_bytes=3 * 10**6)
    assert est.transfer_s(10**9) == pytest.approx(1.003)


def test_per_connection_cap_and_full_pool() -> None:
    capped = LinkEstimate(RATE, 0.0, flow_cap_bytes_per_s=RATE / 10)
    assert capped.transfer_s(10**8) == pytest.approx(1.0)
    full = LinkEstimate(RATE, 0.0, flows_in_flight=4, backlog_bytes=4 * 10**9, pool_size=4)
    assert full.pool_wait_s() == pytest.approx(1.0)
    assert full.transfer_s(10**9) > LinkEstimate(RATE, 0.0, 3, 3 * 10**9, pool_size=4).transfer_s(10**9)


@given(st.integers(0, 10**10), st.integers(0, 10**10), st.integers(0, 300), st.integers(0, 10**11))
def test_estimate_is_monotone_in_size_and_load(a: int, b: int, flows: int, backlog: int) -> None:
    est = LinkEstimate(RATE, 0.01, flows_in_flight=flows, backlog_bytes=backlog if flows else 0)
    lo, hi = sorted((a, b))
    assert est.transfer_s(lo) <= est.transfer_s(hi)
    busier = LinkEstimate(RATE, 0.01, flows_in_flight=flows + 1, backlog_bytes=backlog + 10**6)
    assert est.transfer_s(hi) <= busier.transfer_s(hi) + 1e-9


def test_model_tracks_flows_and_goodput() -> None:
    model = LinkModel(line_bytes_per_s=RATE, rtt_s=0.02)
    model.start_flow("a", 10**9, now=0.0)
    model.start_flow("b", 10**9, now=0.0)
    model.on_progress("a", 4 * 10**8, now=1.0)
    est = model.estimate(now=1.0)
    assert est.flows_in_flight == 2 and est.backlog_bytes == 16 * 10**8
    # the sender measured b at 1 GB in 4 s; a shared the line when b was admitted: 0.5 GB/s seen
    model.finish_flow("b", now=8.0, sent=(10**9, 4.02))
    assert model.estimate(now=8.0).line_bytes_per_s == pytest.approx(0.8 * RATE + 0.2 * 0.5e9, rel=1e-3)
    model.finish_flow("a", now=8.0)
    with pytest.raises(NotFound):
        model.finish_flow("a", now=9.0)
    model.start_flow("c", 1, now=9.0)
    with pytest.raises(InvalidInput):
        model.start_flow("c", 1, now=9.0)
    with pytest.raises(InvalidInput):
        model.on_progress("c", 2, now=9.0)


def test_bad_link_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match="line_bytes_per_s"):
        LinkEstimate(0.0, 0.01)
    with pytest.raises(ConfigError, match="pool_size"):
        LinkModel(line_bytes_per_s=RATE, rtt_s=0.01, pool_size=0)


def test_backlog_report_replaces_the_router_guess() -> None:
    """A fresh report counts each flow at the sender's own figure, drops the flows it finished,
    keeps those it still prepares or that were admitted after it, and adds other senders' ones."""
    from pddlink.routing import BacklogReport

    m = LinkModel(line_bytes_per_s=1e6, rtt_s=0.02)
    m.start_flow("a", 1_000_000, now=0.0)  # shipping: P says 300 kB left
    m.start_flow("b", 500_000, now=0.0)  # finished at P (not in the report)
    m.start_flow("c", 700_000, now=0.0)  # P still prefills it
    assert m.estimate(0.1).backlog_bytes == 2_200_000
    m.observe_backlog(BacklogReport((("a", 300_000), ("other", 50_000)), frozenset({"c"}), at_s=0.5))
    m.start_flow("d", 100_000, now=0.6)  # admitted after the report
    est = m.estimate(0.7)
    assert est.backlog_bytes == 300_000 + 50_000 + 700_000 + 100_000
    assert est.flows_in_flight == 4
    # a stale report no longer counts: back to the admitted flows
    assert m.estimate(5.0).backlog_bytes == 2_300_000


def test_backlog_makes_a_new_transfer_wait() -> None:
    idle = LinkEstimate(2e6, 0.02)
    loaded = LinkEstimate(2e6, 0.02, flows_in_flight=8, backlog_bytes=16_000_000)
    assert loaded.transfer_s(1_500_000) > 5 * idle.transfer_s(1_500_000)


def _goodput_after(sent: tuple[int, float] | None, *, others: int = 0, finish_at: float = 5.0) -> float:
    """One flow of 1 GB on a 1 GB/s, 20 ms line, admitted while ``others`` flows of another sender
    were shipping (its latest report), finished at ``finish_at`` with the sender's ``sent``."""
    from pddlink.routing import BacklogReport

    m = LinkModel(line_bytes_per_s=RATE, rtt_s=0.02)
    shipping = tuple((f"other{i}", 10**9) for i in range(others))
    m.observe_backlog(BacklogReport(shipping, frozenset(), at_s=0.0))
    m.start_flow("mine", 10**9, now=0.1)
    m.finish_flow("mine", now=finish_at, sent=sent)
    return m.estimate(now=finish_at).line_bytes_per_s


def test_the_rate_is_learnt_from_the_transfer_and_the_flows_sharing_it() -> None:
    slow = _goodput_after((10**9, 4.02))  # alone at 0.25 GB/s: the line is slower than configured
    assert slow == pytest.approx(0.8 * RATE + 0.2 * 0.25e9, rel=1e-3)
    # the same seconds while three flows of another sender shared the line: a full line, as set
    assert _goodput_after((10**9, 4.02), others=3) == pytest.approx(RATE)


def test_the_requests_time_and_short_transfers_teach_nothing() -> None:
    # the request ended 100 s after its transfer began (it decoded): the transfer's 1.02 s counts
    assert _goodput_after((10**9, 1.02), finish_at=100.0) == pytest.approx(RATE)
    assert _goodput_after(None, finish_at=100.0) == pytest.approx(RATE)  # no measure: nothing learnt
    # 32 KB in 0.13 s: round trips, not the line (under 4 RTTs of bytes at the line rate)
    assert _goodput_after((32_768, 0.13)) == pytest.approx(RATE)
    assert _goodput_after((10**9, 0.01)) == pytest.approx(RATE)  # under one RTT: nothing
