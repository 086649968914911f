"""Whole runs: the three deployments on a small generated workload, with the real DRC and policy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pddlink.routing import Pipeline
from pddlink.sim.generate import GeneratorConfig, generate
from pddlink.sim.scenario import (
    PaperKnobs,
    line_test_deployments,
    paper_deployments,
    pdd_variants,
    run_deployments,
    sla_of,
)
from pddlink.sim.trace import TraceRequest
from pddlink.sim.workload import load_workload


@pytest.fixture(scope="module")
def small_run() -> tuple[dict, dict]:  # type: ignore[type-arg]
    w = load_workload()
    knobs = PaperKnobs(rate_rps=30, duration_s=90, prewarm_s=60, warmup_s=80, seed=5)
    deps = line_test_deployments(w, knobs)  # speeds that carry 30 req/s (the paper cluster: ~11)
    deps += pdd_variants(deps[-1])
    reqs = tuple(generate(w, GeneratorConfig(rate_rps=30, duration_s=150, seed=5, block_tokens=2048)))
    return run_deployments(reqs, deps, block_tokens=2048, sla=sla_of(w), prewarm_s=60, warmup_s=80)


def test_every_request_finishes_and_keys_are_there(small_run: tuple[dict, dict]) -> None:  # type: ignore[type-arg]
    result, _ = small_run
    assert set(result) >= {"deployments", "rld_token_share", "simulated_s", "wall_s"}
    for name, d in result["deployments"].items():
        assert d["unfinished"] == 0, name
        assert set(d) >= {"ttft_s", "goodput_rps", "cost", "bcr"}
        assert set(d["ttft_s"]) == {"p50", "p90", "p99"}
        assert d["requests"] > 500
    assert result["deployments"]["intra_dc_pd"]["bcr"] == 1.0
    assert result["deployments"]["intra_dc_pd"]["cost"] == 88.0


def test_only_pdd_uses_rld_and_normal_requests_end_on_md(small_run: tuple[dict, dict]) -> None:  # type: ignore[type-arg]
    result, runs = small_run
    for name in ("intra_dc_pd", "cross_dc_pd"):
        assert result["deployments"][name]["pipelines"]["p_md"] == result["deployments"][name]["requests"]
    for rec in runs["pdd"].measured():
        if rec.pipeline is Pipeline.SINGULAR:
            assert rec.rld_tokens == rec.output_tokens and rec.kv_transfer_s < 0
        elif rec.pipeline is Pipeline.P_MD:
            assert rec.rld_tokens == 0
        assert rec.rld_tokens + max(0, rec.output_tokens - rec.rld_tokens) == rec.output_tokens
    d = result["deployments"]
    assert d["pdd_no_singular"]["pipelines"]["singular"] == 0
    assert d["pdd_one_shot"]["handoffs"]["catch_up"] == 0
    assert d["pdd_catch_up"]["handoffs"]["one_shot"] == 0


def test_relay_hides_the_wan_for_relayed_requests(small_run: tuple[dict, dict]) -> None:  # type: ignore[type-arg]
    _, runs = small_run
    relayed = [r for r in runs["pdd"].measured() if r.pipeline is Pipeline.P_RLD_MD]
    for r in relayed:
        # The first token comes from RLD, before the WAN transfer lands at MD.
        assert r.first_token_s - r.prefill_done_s < r.kv_transfer_s + 0.05


def test_a_saturated_line_raises_ttft_and_the_policy_reacts() -> None:
    w = load_workload()
    knobs = PaperKnobs(rate_rps=30, seed=7, wan_gbps=2.0)
    reqs = tuple(generate(w, GeneratorConfig(rate_rps=30, duration_s=120, seed=7, block_tokens=2048)))
    deps = [d for d in line_test_deployments(w, knobs) if d.name != "intra_dc_pd"]
    result, _ = run_deployments(reqs, deps, block_tokens=2048, sla=sla_of(w), prewarm_s=60, warmup_s=70)
    cross, pdd = result["deployments"]["cross_dc_pd"], result["deployments"]["pdd"]
    assert pdd["ttft_s"]["p90"] < cross["ttft_s"]["p90"]
    assert pdd["pipelines"]["p_rld_md"] + pdd["pipelines"]["singular"] > 0


def test_replays_a_given_trace_exactly() -> None:
    w = load_workload()
    reqs = (
        TraceRequest(0, 0.0, 0, tuple(range(10)), 10 * 512, 50, 4096),
        # after the first one's KV has landed on MD (22 MB at one connection's 0.12 Gbit/s: ~1.6 s)
        TraceRequest(1, 5.0, 0, (*range(9), 100), 10 * 512, 50, 4096),
    )
    deps = paper_deployments(w, replace(PaperKnobs(), rate_rps=1))
    _, runs = run_deployments(reqs, deps, block_tokens=512, sla=sla_of(w))
    recs = runs["cross_dc_pd"].measured()
    assert len(recs) == 2 and recs[0].hit == 0.0 and recs[1].hit == pytest.approx(0.9)


def test_sweep_over_line_rate_moves_the_cross_dc_tail() -> None:
    from pddlink.sim.scenario import run_sweep

    w = load_workload()
    knobs = PaperKnobs(rate_rps=6, duration_s=240, prewarm_s=60, warmup_s=90, seed=2)
    result = run_sweep(w, knobs, "line_gbps", [2.0, 40.0])
    slow, fast = (p["cross_dc_pd"]["ttft_s"]["p99"] for p in result["points"])
    assert result["over"] == "line_gbps" and slow > fast


def test_sweep_refuses_unknown_knob() -> None:
    from pddlink.errors import ConfigError
    from pddlink.sim.scenario import run_sweep

    with pytest.raises(ConfigError, match="sweep over"):
        run_sweep(load_workload(), PaperKnobs(), "colour", [1.0])
