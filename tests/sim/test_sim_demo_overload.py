"""The simulator's prediction for ``pddlink demo --scenario wan-overload``: the demo's requests as it
sends them, its line, its three policies as its routers run them, and how two goodput rankings are
compared."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from harness.demo_overload import offered_suffix_bytes_s as demo_suffix_bytes_s
from harness.demo_overload import overload_line_mbit
from harness.demo_workload import build_trace, demo_requests
from pddlink.routing.link import WAN_SHARE_OF_DEADLINE
from pddlink.sim.demo_overload import (
    BLOCKING,
    OVERLOAD_KNOBS,
    demo_line_mbit,
    demo_traffic,
    offered_suffix_bytes_s,
    overload_deployments,
    predict,
    ranking,
    ranking_agrees,
)
from pddlink.sim.records import Sla
from pddlink.sim.scenario import run_deployments

CONVERSATION = Path(__file__).resolve().parents[2] / "examples" / "traces" / "conversation.jsonl"
SLO = Sla(ttft_s=2.0, tpot_s=0.010)


def test_ranking_groups_goodputs_within_the_tie() -> None:
    assert ranking({"a": 3.0, "b": 3.04, "c": 0.0}) == [["b", "a"], ["c"]]
    assert ranking({"a": 3.0, "b": 2.0, "c": 1.0}) == [["a"], ["b"], ["c"]]


def test_rankings_agree_unless_a_pair_is_ordered_both_ways() -> None:
    assert ranking_agrees([["pdd"], ["unbounded"], ["baseline"]], [["pdd"], ["unbounded"], ["baseline"]])
    assert ranking_agrees([["pdd", "unbounded"], ["baseline"]], [["unbounded"], ["pdd"], ["baseline"]])
    assert not ranking_agrees([["pdd"], ["unbounded"], ["baseline"]], [["unbounded"], ["pdd"], ["baseline"]])
    assert not ranking_agrees([["baseline"], ["pdd", "unbounded"]], [["pdd", "unbounded"], ["baseline"]])


@pytest.mark.parametrize("trace_file", [None, str(CONVERSATION)])
def test_the_simulated_requests_are_the_demos(trace_file: str | None) -> None:
    trace = build_trace(requests=60, rate_rps=4.0, seed=1, workload=None, trace_file=trace_file)
    sent = demo_requests(trace, vocab_size=2048)
    sim = demo_traffic(trace)
    assert [r.prompt_tokens for r in sim] == [len(r.prompt) for r in sent]
    assert [r.output_tokens for r in sim] == [r.sampling.max_tokens for r in sent]
    assert [r.arrival_s for r in sim] == pytest.approx([r.arrival_s for r in sent])
    b = trace.meta.block_tokens
    assert all(len(r.block_ids) == -(-r.prompt_tokens // b) for r in sim)


def test_offered_suffix_counts_what_no_earlier_prompt_holds() -> None:
    a = tuple(range(40))  # two full 16-token blocks and 8 tokens more
    b = a[:32] + (99,) * 16
    # a arrives first (warm-up): b misses only its last block; c is new
    c = tuple(range(100, 116))
    got = offered_suffix_bytes_s([a], [(0.0, b), (2.0, c)], kv_bytes_per_token=10, block_tokens=16)
    assert got == pytest.approx((16 + 16) * 10 / 2.0)


def test_the_demo_and_the_simulator_size_the_same_line() -> None:
    trace = build_trace(requests=80, rate_rps=4.0, seed=2, workload=None, trace_file=None)
    every = demo_requests(trace, vocab_size=2048)
    warm, measured = every[:16], every[16:]
    t0 = measured[0].arrival_s
    measured = [replace(r, arrival_s=r.arrival_s - t0) for r in measured]
    direct = offered_suffix_bytes_s(
        [r.prompt for r in warm], [(r.arrival_s, r.prompt) for r in measured], 2048, 16
    )
    assert demo_suffix_bytes_s(warm, measured, 2048) == pytest.approx(direct) and direct > 0


def test_the_three_policies_are_the_demos_routers() -> None:
    base, pdd, unbounded = overload_deployments(3.3, SLO)
    assert (base.name, pdd.name, unbounded.name) == ("baseline", "pdd", "unbounded")
    assert base.deadline_s is None and not base.policy.recompute_enabled  # ship only, no admission
    for d in (pdd, unbounded):
        assert d.policy.recompute_enabled and d.md_chunk_tokens == BLOCKING
        assert d.deadline_s == pytest.approx(WAN_SHARE_OF_DEADLINE * OVERLOAD_KNOBS.deadline_s)
        assert d.link.wan_gbps == pytest.approx(3.3 / 1000)
    assert pdd.tpot_bound_s == SLO.tpot_s and pdd.ttft_deadline_s == SLO.ttft_s
    assert pdd.policy.rld_token_budget == OVERLOAD_KNOBS.rld_token_budget
    assert unbounded.tpot_bound_s is None and unbounded.ttft_deadline_s is None
    assert unbounded.policy.rld_token_budget == 1.0


def test_on_the_conversation_trace_the_baseline_ranks_last() -> None:
    trace = build_trace(requests=120, rate_rps=4.0, seed=1, workload=None, trace_file=str(CONVERSATION))
    every = demo_requests(trace, vocab_size=2048)
    warm, measured = every[:16], every[16:]
    t0 = measured[0].arrival_s
    measured = [replace(r, arrival_s=r.arrival_s - t0) for r in measured]
    line = overload_line_mbit(demo_suffix_bytes_s(warm, measured, 2048))
    got = predict(trace, 16, line, SLO)
    p = got["policies"]
    assert set(p) == {"baseline", "pdd", "unbounded"}
    assert got["ranking"][-1] == ["baseline"]  # 2x the line: shipped suffixes queue past the TTFT SLO
    assert p["baseline"]["ttft_p90_s"] > SLO.ttft_s > p["pdd"]["ttft_p90_s"]
    assert p["pdd"]["goodput_rps"] > p["baseline"]["goodput_rps"]


def test_the_simulator_sizes_the_demos_line_from_the_trace_alone() -> None:
    trace = build_trace(requests=80, rate_rps=4.0, seed=2, workload=None, trace_file=str(CONVERSATION))
    every = demo_requests(trace, vocab_size=2048)
    warm, measured = every[:16], every[16:]
    t0 = measured[0].arrival_s
    measured = [replace(r, arrival_s=r.arrival_s - t0) for r in measured]
    want = overload_line_mbit(demo_suffix_bytes_s(warm, measured, 2048))
    assert demo_line_mbit(trace, 16) == pytest.approx(want)


def test_the_demo_reports_both_predictions_and_whether_each_agrees() -> None:
    from harness.demo import sim_prediction
    from harness.demo_report import Slo

    trace = build_trace(requests=100, rate_rps=4.0, seed=1, workload=None, trace_file=str(CONVERSATION))
    line = demo_line_mbit(trace, 16)
    swapped = {"baseline": 0.0, "pdd": 1.0, "unbounded": 3.0}
    got = sim_prediction(trace, 16, line, Slo(), swapped, base_tpot_s=0.0)
    assert got["measured_ranking"] == [["unbounded"], ["pdd"], ["baseline"]]
    assert got["agrees"] is ranking_agrees(got["ranking"], got["measured_ranking"])
    calibrated = got["at_calibrated_speed"]
    assert got["slowdown"] == 1.0 and calibrated["policies"] == got["policies"]  # nothing measured
    fast = sim_prediction(trace, 16, line, Slo(), swapped, base_tpot_s=0.0015)
    assert fast["slowdown"] < 1.0  # the engine got faster than the simulator was calibrated at
    assert fast["policies"]["unbounded"]["tpot_p50_s"] < calibrated["policies"]["unbounded"]["tpot_p50_s"]
    assert fast["at_calibrated_speed"]["policies"] == calibrated["policies"]
    slow = sim_prediction(trace, 16, line, Slo(), swapped, base_tpot_s=0.0084)
    assert slow["slowdown"] > 1.5
    assert slow["policies"]["unbounded"]["tpot_p50_s"] > calibrated["policies"]["unbounded"]["tpot_p50_s"]


def test_md_prefill_slowdown_gives_mds_pool_a_chip_that_prefills_that_much_slower() -> None:
    same = overload_deployments(3.3, SLO)
    slow = overload_deployments(3.3, SLO, replace(OVERLOAD_KNOBS, md_prefill_slowdown=4.0))
    for a, b in zip(same, slow, strict=True):
        assert a.decode.hw.prefill_rel == 1.0 and b.decode.hw.prefill_rel == pytest.approx(0.25)
        assert b.decode.hw.decode_rel == a.decode.hw.decode_rel  # decoding as fast as before
        assert b.prefill == a.prefill  # P's chips unchanged


def test_rld_on_ps_chips_decodes_slower_while_p_prefills() -> None:
    """The demo runs RLD on P's CPUs (MD has its own): every P prefill batch holds RLD's decode,
    so the simulator's relayed requests finish later with the chips shared than on chips of their
    own, and requests MD alone decodes are untouched."""
    trace = build_trace(requests=60, rate_rps=4.0, seed=1, workload=None, trace_file=str(CONVERSATION))
    shared = overload_deployments(3.3, SLO)
    assert all(d.rld_shares_p_chips for d in shared if d.relay is not None)
    apart_knobs = replace(OVERLOAD_KNOBS, demo=replace(OVERLOAD_KNOBS.demo, rld_shares_p_chips=False))
    assert not any(d.rld_shares_p_chips for d in overload_deployments(3.3, SLO, apart_knobs))
    requests = demo_traffic(trace, OVERLOAD_KNOBS)
    relay_only = replace(shared[1], name="relay", tpot_bound_s=None, ttft_deadline_s=None, deadline_s=None)
    relay_only = replace(
        relay_only,
        # no budget either: the simulator held the bounded policy's RLD budget (0.08) only once its
        # no-deadline shortcut stopped ignoring budgets
        policy=replace(relay_only.policy, recompute_enabled=False, relay_min_wan_s=0.0, rld_token_budget=1.0),
    )
    speeds = {}
    for name, d in (("shared", relay_only), ("apart", replace(relay_only, rld_shares_p_chips=False))):
        result, _ = run_deployments(requests, [d], block_tokens=trace.meta.block_tokens, sla=SLO)
        got = result["deployments"]["relay"]
        assert got["rld_token_share"] > 0.2, got["rld_token_share"]  # RLD decoded much of it
        speeds[name] = got["tokens_per_s_per_request"]
    assert speeds["shared"] < speeds["apart"]
