"""``harness.vllm_serve_bench``'s report from ``vllm bench serve`` results and its router config
(no vLLM started: the benchmark itself runs on real vLLM servers, ``pddlink bench vllm-serve``)."""

from __future__ import annotations

import tomllib
from typing import Any

from harness.vllm_serve_bench import METRICS, PERCENTILES, figures, ratios, router_toml, table


def _result(scale: float, failed: int = 0) -> dict[str, Any]:
    """What ``vllm.benchmarks.serve.main`` returns, the keys the report reads."""
    out: dict[str, Any] = {"completed": 8 - failed, "failed": failed, "total_output_tokens": 128}
    out["errors"] = ["", "boom"][: failed + 1]
    for k, m in enumerate(METRICS):
        for p in PERCENTILES:
            out[f"p{p}_{m}_ms"] = scale * (k + 1) * p / 10
    return out


def test_figures_ratios_and_table() -> None:
    straight, router = figures(_result(1.0)), figures(_result(3.0, failed=1))
    assert straight["completed"] == 8 and straight["errors"] == []
    assert router["failed"] == 1 and router["errors"] == ["boom"]
    assert straight["p50_ttft_ms"] == 5.0 and router["p99_itl_ms"] == 89.1
    r = ratios(router, straight)
    assert set(r) == {f"p{p}_{m}_ms" for m in METRICS for p in PERCENTILES}
    assert all(v == 3.0 for v in r.values())
    zero = {**straight, "p50_ttft_ms": 0.0}
    assert ratios(router, zero)["p50_ttft_ms"] is None  # no ratio to a zero
    out = {"runs": {"openai": {"straight": straight, "router": router, "ratio": r}}}
    lines = table(out).splitlines()
    assert len(lines) == 4 and lines[0].split()[:3] == ["backend", "side", "ok/fail"]
    assert lines[2].split()[:3] == ["openai", "router", "7/1"] and lines[3].split()[2] == "3.00"


def test_router_toml_fronts_the_servers_given() -> None:
    urls = {"p": "http://127.0.0.1:1", "md": "http://127.0.0.1:2", "rld": "http://127.0.0.1:3"}
    conf = tomllib.loads(router_toml(urls, "/m", 8123, "ipc:///e"))
    assert conf["engine"] == "vllm" and conf["http_port"] == 8123
    assert conf["vllm"] == {
        "p_url": urls["p"], "md_url": urls["md"], "model": "/m", "rld_url": urls["rld"],
        "rld_gets_kv": True, "md_kv_events": "ipc:///e",
    }  # fmt: skip
    assert conf["api"]["model"] == "tiny" and conf["api"]["rate_per_client_s"] == 0.0
    no_rld = tomllib.loads(router_toml({"p": urls["p"], "md": urls["md"]}, "/m", 8124))
    assert "rld_url" not in no_rld["vllm"] and "md_kv_events" not in no_rld["vllm"]
