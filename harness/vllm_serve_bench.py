"""``pddlink bench vllm-serve``: vLLM's own benchmark client (``vllm bench serve``, in-process:
``vllm.benchmarks.serve``, as the command runs it) against the router in front of vLLM servers,
and the same command straight at one vLLM server of the same model, in the same run (issue 27).

The deployment: P, RelayDecode and MainDecode as vLLM servers (float32 tiny Llama) beside their
sidecars (``VllmTrio``), MD's KV port on loopback (no WAN delay), and ``pddlink router --config``
(``engine = "vllm"``) in front of them, placing every request itself (P->MD or P->RLD->MD). The
straight side is MD's vLLM server, called without transfer parameters (its connector takes no
part). For each backend (``openai``: /v1/completions, ``openai-chat``: /v1/chat/completions) the
client runs once straight, once through the router, with the same dataset shape (random tokens,
``input_len`` in, ``output_len`` out, ``--ignore-eos`` so both sides produce every token) and a
seed of its own per run, so that no run finds the prompts of another in a prefix cache.

JSON: the set-up, then per backend the two runs' completed/failed counts and TTFT/TPOT/ITL
percentiles (ms), and ``ratio``: router / straight for each figure. ``errors``: failed requests
over every run. ``router_pipelines``: the router's ``pddlink_requests_total`` by pipeline and outcome (where
its requests went).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness.router_proc import router_from_config

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
METRICS = ("ttft", "tpot", "itl")
PERCENTILES = (50, 90, 99)
SERVED = "tiny"  # the name the servers and the router serve


@dataclass(frozen=True, slots=True)
class ServeBenchSpec:
    prompts: int = 24  # per run
    input_len: int = 256
    output_len: int = 32
    concurrency: int = 4
    seed: int = 27
    backends: tuple[str, ...] = tuple(BACKENDS)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def router_toml(urls: dict[str, str], model: str, port: int, md_kv_events: str = "") -> str:
    """``pddlink router --config`` over the servers in ``urls`` (p, md, optionally rld)."""
    relay = f'rld_url = "{urls["rld"]}"\nrld_gets_kv = true\n' if urls.get("rld") else ""
    events = f'md_kv_events = "{md_kv_events}"\n' if md_kv_events else ""
    return (
        f'engine = "vllm"\nhost = "127.0.0.1"\ngrpc_port = 0\nhttp_port = {port}\n'
        "vocab_size = 1024\nmax_prompt_tokens = 4000\nline_mbit = 1000\nrtt_ms = 1\n"
        f'[vllm]\np_url = "{urls["p"]}"\nmd_url = "{urls["md"]}"\nmodel = "{model}"\n{relay}{events}'
        f'[api]\nmodel = "{SERVED}"\ntokenizer = "{model}"\nrate_per_client_s = 0.0\n'
    )


@contextlib.contextmanager
def router_process(workdir: Path, toml: str, port: int) -> Iterator[str]:
    """``pddlink router --config`` with ``toml``; its base URL until the block ends."""
    conf = workdir / f"router-{port}.toml"
    conf.write_text(toml)
    with router_from_config(conf, port, log=workdir / f"router-{port}.log"):
        yield f"http://127.0.0.1:{port}"


def bench_once(
    base_url: str, backend: str, tokenizer: Path, spec: ServeBenchSpec, seed: int
) -> dict[str, Any]:
    """One ``vllm bench serve`` run (its own argument parser, so its defaults are vLLM's)."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
    serve.add_cli_args(parser)
    args = parser.parse_args(
        ["--backend", backend, "--base-url", base_url, "--endpoint", BACKENDS[backend],
         "--model", SERVED, "--tokenizer", str(tokenizer), "--dataset-name", "random",
         "--random-input-len", str(spec.input_len), "--random-output-len", str(spec.output_len),
         "--num-prompts", str(spec.prompts), "--max-concurrency", str(spec.concurrency),
         "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
         "--percentile-metrics", ",".join(METRICS),
         "--metric-percentiles", ",".join(map(str, PERCENTILES))]
    )  # fmt: skip
    return dict(serve.main(args))


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of one run."""
    out: dict[str, Any] = {
        "completed": int(result["completed"]),
        "failed": int(result.get("failed", 0)),
        "errors": [e for e in result.get("errors") or [] if e][:5],
        "output_tokens": int(result["total_output_tokens"]),
    }
    for m in METRICS:
        for p in PERCENTILES:
            out[f"p{p}_{m}_ms"] = round(float(result[f"p{p}_{m}_ms"]), 2)
    return out


SERVE_KEYS = tuple(f"p{p}_{m}_ms" for m in METRICS for p in PERCENTILES)  # the client's figures


def ratios(
    row: dict[str, Any], base: dict[str, Any], keys: tuple[str, ...] = SERVE_KEYS, digits: int = 2
) -> dict[str, float | None]:
    """``row``'s figures over ``base``'s, key by key (None where the base is 0)."""
    return {k: (round(row[k] / base[k], digits) if base.get(k) else None) for k in keys}


def _pipelines(router_url: str, key: str = "") -> dict[str, int]:
    """Requests the router ended, by "pipeline/outcome" (its ``pddlink_requests_total``); ``key``:
    the router's client key, where it takes one."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        text = httpx.get(router_url + "/metrics", timeout=10, headers=headers).text
    except httpx.HTTPError:
        return {}
    out: dict[str, int] = {}
    for labels, value in re.findall(r"^pddlink_requests_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        d = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = f"{d.get('pipeline', '?')}/{d.get('outcome', '?')}"
        out[key] = out.get(key, 0) + int(float(value))
    return out


def compare(straight_url: str, router_url: str, tokenizer: Path, spec: ServeBenchSpec) -> dict[str, Any]:
    """Each backend straight, then through the router; the JSON body (see the module docstring)."""
    runs: dict[str, Any] = {}
    seed = spec.seed
    for backend in spec.backends:
        row: dict[str, Any] = {}
        for side, url in (("straight", straight_url), ("router", router_url)):
            t0 = time.monotonic()
            row[side] = figures(bench_once(url, backend, tokenizer, spec, seed))
            row[side]["seconds"] = round(time.monotonic() - t0, 1)
            seed += 1
            say(f"  {backend} {side}: {row[side]['completed']} completed, {row[side]['failed']} failed")
        row["ratio"] = ratios(row["router"], row["straight"])
        runs[backend] = row
    return {
        "client": "vllm bench serve (vllm.benchmarks.serve, in-process), dataset random, --ignore-eos",
        "prompts_per_run": spec.prompts,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "max_concurrency": spec.concurrency,
        "runs": runs,
        "errors": sum(r[s]["failed"] for r in runs.values() for s in ("straight", "router")),
        "router_pipelines": _pipelines(router_url),
    }


def table(out: dict[str, Any]) -> str:
    """The side-by-side table, one line per backend and side."""
    head = "backend      side      ok/fail  " + "  ".join(
        f"{m.upper()} p{p:<2}" for m in METRICS for p in PERCENTILES
    )
    lines = [head]
    for backend, row in out["runs"].items():
        for side in ("straight", "router", "ratio"):
            r = row[side]
            cells = [r[f"p{p}_{m}_ms"] for m in METRICS for p in PERCENTILES]
            ok = f"{r['completed']}/{r['failed']}" if side != "ratio" else ""
            fmt = [f"{c:>8.2f}" if c is not None else f"{'-':>8}" for c in cells]
            lines.append(f"{backend:<12} {side:<9} {ok:>7}  " + "  ".join(fmt))
    return "\n".join(lines)


def run(spec: ServeBenchSpec) -> dict[str, Any]:
    import vllm.distributed.kv_events  # noqa: F401  (before the sidecars' loop imports it)

    from harness.vllm.pair import PairSpec, VllmTrio, free_port
    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="pddlink-vs-"))  # sockets: keep the path short
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype="float32"))
    try:
        t0 = time.monotonic()
        trio = VllmTrio(
            PairSpec(
                root / "w", model, dtype="float32", extra_args=("--served-model-name", str(model), SERVED)
            )
        )
        try:
            trio.start()
            say(f"P, RLD and MD vLLM servers (float32) up in {time.monotonic() - t0:.1f} s")
            urls = {k: s.url for k, s in trio.servers().items()}
            port = free_port()
            toml = router_toml(urls, str(model), port, trio.md_kv_events)
            with router_process(root, toml, port) as router_url:
                out = compare(urls["md"], router_url, model, spec)
        finally:
            trio.close()
        out["deployment"] = (
            "router (pddlink router --config, engine vllm) over P, RLD and MD vLLM servers,"
            " loopback, no WAN delay"
        )
        out["straight"] = "MD's vLLM server, no transfer parameters"
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
