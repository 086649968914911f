"""vLLM's own benchmark client, unchanged, against the router (issue 27, item 2).

``vllm bench serve --backend openai`` sent ``repetition_penalty: 1.0`` on every request and the
router refused it as an unknown field, so the benchmark stopped at its first request. Here it runs
(in-process: ``vllm.benchmarks.serve``, as the ``vllm bench serve`` command does) with the
completions and the chat backends, random dataset, against a router in front of the reference
engine (P, RLD and MD sidecars) whose ``[api] tokenizer`` is the tiny model's: every request
completes, none fails.

Then the same client against the router in front of vLLM itself (``engine = "vllm"``, ``pddlink
router --config`` over the session's shared trio: P, RelayDecode and MainDecode as vLLM servers) and
straight at MD's vLLM server, in the same run (``harness.vllm_serve_bench``, the body of ``pddlink
bench vllm-serve``): both backends, 0 failures on either side, every answer ``output_len`` tokens
long; the TTFT/TPOT/ITL percentiles side by side and their ratios are printed (``pytest -s``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.edge_bench import deployment
from harness.router_proc import RouterProc

pytestmark = [pytest.mark.process, pytest.mark.vllm, pytest.mark.timeout(300)]
PROMPTS = 12


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_llama_f32: Path) -> Iterator[RouterProc]:
    tmp = tmp_path_factory.mktemp("bench")
    api = {"tokenizer": str(tiny_llama_f32), "model": "tiny", "rate_per_client_s": 0.0}
    with deployment(tmp, api) as r:  # P, RLD and MD (reference engine, mutual TLS), a router process
        yield r


@pytest.mark.parametrize(
    ("backend", "endpoint"), [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")]
)
def test_vllm_bench_serve_runs_unchanged_against_the_router(
    router: RouterProc, tiny_llama_f32: Path, backend: str, endpoint: str
) -> None:
    serve = pytest.importorskip("vllm.benchmarks.serve", reason="vLLM is not installed")
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(
        ["--backend", backend, "--base-url", f"http://127.0.0.1:{router.port}", "--endpoint", endpoint,
         "--model", "tiny", "--tokenizer", str(tiny_llama_f32), "--dataset-name", "random",
         "--random-input-len", "64", "--random-output-len", "16", "--num-prompts", str(PROMPTS),
         "--max-concurrency", "4", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    )  # fmt: skip
    result = serve.main(args)
    print(
        f"\n{backend}: {result['completed']} completed, {result['failed']} failed; TTFT median "
        f"{result['median_ttft_ms']:.1f} ms, P99 {result['p99_ttft_ms']:.1f} ms; TPOT median "
        f"{result['median_tpot_ms']:.1f} ms; ITL median {result['median_itl_ms']:.1f} ms"
    )
    assert result["completed"] == PROMPTS and result["failed"] == 0, result.get("errors")
    assert result["total_output_tokens"] > 0


@pytest.mark.fleet
def test_vllm_bench_serve_through_the_router_on_vllm_beside_one_vllm(vllm_trio: Any, tmp_path: Path) -> None:
    pytest.importorskip("vllm.benchmarks.serve", reason="vLLM is not installed")
    from harness.vllm.pair import free_port
    from harness.vllm_serve_bench import BACKENDS, ServeBenchSpec, compare, router_process, router_toml, table

    trio = vllm_trio
    urls = {k: s.url for k, s in trio.servers().items()}
    spec = ServeBenchSpec(prompts=PROMPTS, input_len=128, output_len=16, concurrency=4)
    port = free_port()
    toml = router_toml(urls, str(trio.spec.model), port, trio.md_kv_events)
    with router_process(tmp_path, toml, port) as router_url:
        out = compare(urls["md"], router_url, trio.spec.model, spec)
    print("\n" + table(out) + f"\nrouter pipelines: {out['router_pipelines']}")
    assert out["errors"] == 0, out
    for backend in BACKENDS:
        for side in ("straight", "router"):
            run = out["runs"][backend][side]
            assert run["completed"] == PROMPTS and run["output_tokens"] == PROMPTS * 16, (backend, side, run)
    finished = sum(n for k, n in out["router_pipelines"].items() if k.endswith("/finished"))
    assert finished >= 2 * PROMPTS, out["router_pipelines"]  # each request ran through the router
