"""`pddlink sim` end to end through the installed command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CMD = [sys.executable, "-m", "pddlink.cli.main", "sim"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_generate_then_replay_trace_json(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    gen = _run("generate", "--out", str(trace), "--requests", "300", "--rate", "10", "--block-tokens", "512")
    assert gen.returncode == 0, gen.stderr
    assert len(trace.read_text().splitlines()) == 301
    out = _run("--trace", str(trace), "--json", "--plots", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert set(data["deployments"]) == {"intra_dc_pd", "cross_dc_pd", "pdd"}
    for d in data["deployments"].values():
        assert {"p50", "p90", "p99"} <= set(d["ttft_s"]) and {"goodput_rps", "cost", "bcr"} <= set(d)
    assert 0 <= data["rld_token_share"] < 1 and data["simulated_s"] > 0 and data["wall_s"] > 0
    assert data["fallbacks"]["p_md"]["md_lost_mid_stream"]["fallbacks"] == ["md_lost_p_rld"]
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 1000


def test_bad_trace_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"pddlink_trace": 1, "block_tokens": 16}\n{"id": 0}\n')
    out = _run("--trace", str(bad), "--json")
    assert out.returncode != 0 and out.stdout == ""
    assert "bad.jsonl:2" in out.stderr and "arrival_s" in out.stderr


def test_needs_exactly_one_source() -> None:
    out = _run("--json")
    assert out.returncode != 0 and "exactly one of" in out.stderr


@pytest.mark.slow
def test_skew_json_small(tmp_path: Path) -> None:
    out = _run("skew", "--rate", "40", "--duration", "60", "--seeds", "2", "--json", "--plots", str(tmp_path))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["skewed"]["kv_transfer_s"]["p50"] < data["uniform"]["kv_transfer_s"]["p50"]
    assert data["seed"] == 1 and data["across_seeds"]["seeds"] == [1, 2]
    assert len(data["across_seeds"]["p50_ratio"]) == 2 and "pool_full_share" in data["definitions"]
    assert (tmp_path / "kv_transfer_skew.png").exists()


def test_demo_scale_scenario_runs_and_pdd_cuts_the_tail() -> None:
    out = _run("--scenario", "demo", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    d = data["deployments"]
    assert set(d) == {"cross_dc_pd", "pdd"}
    assert d["pdd"]["ttft_s"]["p90"] < d["cross_dc_pd"]["ttft_s"]["p90"]
    knobs = data["scenario"]["knobs"]  # the default demo's outputs, not the pools demo's
    assert (knobs["output_divisor"], knobs["max_output"]) == (4, 512)


def test_wan_load_sweep_json_and_png(tmp_path: Path) -> None:
    out = _run("sweep", "--wan-load", "0.5,2", "--duration", "300", "--json", "--plots", str(tmp_path))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = {(r["deployment"], r["wan_load"]): r for r in data["rows"]}
    policies = ("cross_dc_pd", "pdd", "pdd_recompute", "pdd_bounded")
    assert set(rows) == {(d, x) for d in policies for x in (0.5, 2.0)}
    for r in rows.values():
        assert {"p90", "p99"} <= set(r["ttft_s"]) and 0 <= r["rld_token_share"] <= 1
        assert 0 <= r["rejected_share"] <= 1 and r["goodput_rps"] >= 0
        assert r["tokens_per_s_per_request"] > 0 and r["tpot_s"]["p90"] is not None
    assert [p["wan_load"] for p in data["bounded_lead"]] == [0.5, 2.0]
    assert data["slo"] == {"ttft_s": 30.0, "tpot_s": 0.03} and data["md_chunk_tokens"] == 256
    assert data["bounded_at_or_above_best"] is True
    assert (tmp_path / "wan_load.png").stat().st_size > 1000


def test_bathtub_sweep_and_slo_flags(tmp_path: Path) -> None:
    out = _run(
        "--slo-tpot-ms", "40", "sweep", "--bathtub", "0.97", "--duration", "200", "--search-steps", "2",
        "--slo-ttft-ms", "20000", "--json", "--plots", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["slo"] == {"ttft_s": 20.0, "tpot_s": 0.04}  # the group's TPOT, the sweep's own TTFT
    rows = {r["deployment"]: r for r in data["rows"]}
    assert set(rows) == {"intra_dc_pd", "cross_dc_pd", "pdd", "pdd_recompute", "pdd_bounded"}
    assert rows["intra_dc_pd"]["bcr"] == 1.0 and all(r["sustained_rps"] > 0 for r in rows.values())
    assert set(data["valley"]["floors"]) == set(rows) - {"intra_dc_pd"}
    assert data["search"]["steps"] == 2  # probes 12.1 then 6.2 req/s: intra-DC PD sustains the latter
    assert (tmp_path / "bathtub.png").stat().st_size > 1000


def test_wan_load_needs_its_values() -> None:
    out = _run("sweep", "--json")
    assert out.returncode != 0 and "--wan-load" in out.stderr
    bad = _run("sweep", "--wan-load", "0,1")
    assert bad.returncode != 0 and "> 0" in bad.stderr
    both = _run("sweep", "--wan-load", "1", "--bathtub", "0.5")
    assert both.returncode != 0 and "one of" in both.stderr
    hit = _run("sweep", "--bathtub", "0.5,1.5")
    assert hit.returncode != 0 and "[0, 1]" in hit.stderr
    slo = _run("--slo-tpot-ms", "0", "--scenario", "demo")
    assert slo.returncode != 0 and "--slo-tpot-ms" in slo.stderr


def test_fallbacks_table_is_the_routers_machine() -> None:
    out = _run("fallbacks", "--json", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    relay = table["p_rld_md"]
    assert relay["md_unreachable"]["fallbacks"] == ["md_unreachable_rld_finishes"]
    assert relay["md_unreachable"]["tokens"] == {"rld": 8}
    assert table["p_md"]["md_unreachable_rld_down"]["outcome"] == "failed"
    assert table["p_md"]["md_unreachable_rld_down"]["reason"] == "md_unreachable"
    bad = _run("fallbacks", "--max-tokens", "0")
    assert bad.returncode == 2 and "--max-tokens" in bad.stderr


def test_generate_a_conversation_and_predict_the_demos_overload_on_it(tmp_path: Path) -> None:
    trace = tmp_path / "c.jsonl"
    gen = _run("generate", "--conversation", "--out", str(trace), "--requests", "120", "--rate", "2")
    assert gen.returncode == 0, gen.stderr
    out = _run("demo-overload", "--trace", str(trace), "--requests", "100", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data["policies"]) == {"baseline", "pdd", "unbounded"} and data["line_mbit"] > 0
    assert sorted(n for g in data["ranking"] for n in g) == ["baseline", "pdd", "unbounded"]
    assert data["ranking"][-1] == ["baseline"]
    slow = _run(
        "demo-overload", "--trace", str(trace), "--requests", "100", "--json", "--md-prefill-slowdown", "4"
    )
    assert slow.returncode == 0, slow.stderr
    slowed = json.loads(slow.stdout)
    assert slowed["md_prefill_slowdown"] == 4.0
    # MD's recompute is 4x as slow: no policy's prediction is the same as on MD's usual chips
    assert slowed["policies"]["unbounded"] != data["policies"]["unbounded"]
