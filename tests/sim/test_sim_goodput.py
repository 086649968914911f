"""Goodput as the highest sustained SLA rate: attainment on hand-made records, the search on real runs."""

from __future__ import annotations

import pytest

from pddlink.errors import ConfigError
from pddlink.routing import Pipeline
from pddlink.sim.deploy import Link
from pddlink.sim.goodput import GeneratedTraffic, RateSearch, attainment, line_load, sustained_goodput
from pddlink.sim.records import Record, RunRecords, Sla
from pddlink.sim.scenario import PaperKnobs, line_test_deployments, paper_deployments, sla_of
from pddlink.sim.workload import load_workload

SLA = Sla(ttft_s=1.0, tpot_s=0.1)


def record(arrival: float, first: float, finish: float, out: int, measured: bool = True) -> Record:
    r = Record(arrival, out, Pipeline.P_MD, measured)
    r.first_token_s, r.finish_s = first, finish
    return r


def test_attainment_counts_both_bounds_and_unfinished_requests() -> None:
    recs = RunRecords()
    recs.add(record(0.0, 0.5, 0.5 + 9 * 0.1, 10))  # meets both (tpot exactly the bound)
    recs.add(record(1.0, 2.5, 3.0, 10))  # TTFT 1.5 s: misses
    recs.add(record(2.0, 2.1, 2.1 + 9 * 0.2, 10))  # TPOT 0.2 s: misses
    recs.add(record(3.0, 3.2, -1.0, 10))  # never finished: counts against
    recs.add(record(4.0, 9.0, 9.0, 1, measured=False))  # warm-up: ignored
    assert attainment(recs, SLA) == pytest.approx(1 / 4)
    assert attainment(recs, SLA, since_s=2.0) == 0.0
    assert attainment(RunRecords(), SLA) == 0.0


def test_rate_search_rejects_bad_brackets() -> None:
    with pytest.raises(ConfigError, match="lo_rps < hi_rps"):
        RateSearch(lo_rps=10, hi_rps=10)
    with pytest.raises(ConfigError):
        RateSearch(lo_rps=1, hi_rps=10, steps=0)
    with pytest.raises(ConfigError):
        RateSearch(lo_rps=1, hi_rps=10, attainment=1.5)


def test_a_thin_line_bounds_the_sustained_rate_of_cross_dc_pd() -> None:
    """On a 4 Gbit/s line cross-DC PD cannot carry the paper's rates: the search lands where the
    offered KV bytes reach the line, and every probe above the result failed."""
    w = load_workload()
    knobs = PaperKnobs(seed=3)
    cross = line_test_deployments(w, knobs, link=Link(wan_gbps=4.0, pool_size=24, flow_cap_gbps=4.0))[1]
    search = RateSearch(lo_rps=2, hi_rps=40, steps=4, window_s=60, warmup_s=30, prewarm_s=30)
    traffic = GeneratedTraffic(w, knobs.seed, knobs.block_tokens, search.duration_s)
    got = sustained_goodput(cross, traffic, knobs.block_tokens, sla_of(w), search)
    rate = got["sustained_rps"]
    assert 2 < rate < 40 and 0 < got["goodput_rps"] <= rate
    passed = [p for p in got["probes"] if p[0] <= rate]
    failed = [p for p in got["probes"] if p[0] > rate]
    assert failed and all(p[3] > search.max_line_load or min(p[1], p[2]) < search.attainment for p in failed)
    assert any(p[3] > search.max_line_load for p in failed)  # the line is what binds here
    assert all(p[3] <= search.max_line_load for p in passed if p[0] == rate)


def test_line_load_is_zero_inside_one_datacenter() -> None:
    w = load_workload()
    intra = paper_deployments(w, PaperKnobs())[0]
    recs = RunRecords()
    r = record(0.0, 0.1, 0.2, 2)
    r.missing_tokens = 10**6
    recs.add(r)
    assert line_load(recs, intra, 10.0) == 0.0
