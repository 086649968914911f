"""``pddlink bench vllm``: the connector's own cost against P's prefill, and against vLLM's
``ExampleConnector``, in one run, for prompts of 512, 2048 and 8192 tokens.

Per size (``--repeats`` distinct random prompts each, median reported):
  prefill_s      P's vLLM prefilling the prompt alone (max_tokens 1, no prefix hit, no connector
                 work: a request without kv_transfer_params)
  kv_bytes       the prompt's KV (whole blocks)
  pddlink        save_s: P's connector handing the KV out (ALLOC sent before the forward, its
                 answer read after it, copy out of the paged cache, COMMIT sent), with its phases
                 (save_phases: alloc_send_s, alloc_s, copy_s, commit_s, and the copy path);
                 load_s: MD's connector taking it in (copy into the allocated blocks); the wire
                 is excluded (P->MD over loopback); overhead = (save + load) / prefill
  example        the same two hooks of vLLM's ExampleConnector (safetensors files in a temp dir)
                 on one vLLM (prefix caching off, so the second request loads from the connector;
                 ``TimedExampleConnector`` makes its load run on vLLM's CPU runner)
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engines_adapter.vllm.pair import PairSpec, VllmPair, free_port
from engines_adapter.vllm.server import VllmServer, VllmServerSpec
from engines_adapter.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama
from router.vllm_driver import DriveRequest, VllmDriver

SIZES = (512, 2048, 8192)


def _records(d: Path, op: str) -> list[dict[str, Any]]:
    out = []
    for f in d.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["op"] == op:
                out.append(rec)
    return out


def _timings(d: Path, op: str) -> list[float]:
    return [float(r["seconds"]) for r in _records(d, op)]


def _phases(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each timed phase of the records, and the copy path(s) they took."""
    out: dict[str, Any] = {
        k: statistics.median(float(r[k]) for r in records)
        for k in ("alloc_send_s", "alloc_s", "copy_s", "commit_s")
        if records and all(k in r for r in records)
    }
    out["path"] = sorted({str(r.get("path")) for r in records})
    return out


def _clear(d: Path) -> None:
    for f in d.glob("*.jsonl"):
        f.unlink()


def _prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, 1024) for _ in range(n))


async def _prefill_s(http: httpx.AsyncClient, url: str, model: str, prompt: tuple[int, ...]) -> float:
    body = {"model": model, "prompt": list(prompt), "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = await http.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - t0


def run(dtype: str, repeats: int, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="pddlink-bench-vllm-"))
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype=dtype))
    timing = root / "timing"
    timing.mkdir()
    rng = random.Random(0)
    extra = ("--max-num-batched-tokens", str(max(sizes) + 64))
    max_len = max(sizes) + 64
    results: dict[int, dict[str, Any]] = {n: {"prompt_tokens": n} for n in sizes}
    spec = PairSpec(
        root / "w",
        model,
        dtype=dtype,
        timing_dir=timing,
        extra_args=("--max-model-len", str(max_len), *extra),
    )
    pair = VllmPair(spec)
    try:
        pair.start()

        async def ours() -> None:
            assert pair.p is not None and pair.md is not None
            http = httpx.AsyncClient()
            driver = VllmDriver(pair.p.url, pair.md.url, str(model))
            try:
                for n in sizes:
                    pre: list[float] = []
                    saves: list[dict[str, Any]] = []
                    loads: list[float] = []
                    for _ in range(repeats):
                        pre.append(await _prefill_s(http, pair.p.url, str(model), _prompt(rng, n)))
                        _clear(timing)
                        await driver.run_p_md(DriveRequest(_prompt(rng, n), 1, 120.0))
                        saves += _records(timing, "save")
                        loads += _timings(timing, "load")
                    results[n]["prefill_s"] = statistics.median(pre)
                    results[n]["pddlink"] = {
                        "save_s": statistics.median(float(r["seconds"]) for r in saves),
                        "load_s": statistics.median(loads),
                        "save_phases": _phases(saves),
                    }
            finally:
                await driver.close()
                await http.aclose()

        asyncio.run(ours())
    finally:
        pair.close()
    _clear(timing)
    store = root / "example-kv"
    store.mkdir()
    base = VllmServer(
        VllmServerSpec(
            model,
            free_port(),
            dtype=dtype,
            max_model_len=max_len,
            kv_role="kv_both",
            kv_connector="TimedExampleConnector",
            kv_connector_module="engines_adapter.vllm.timed_example",
            connector_extra=(("shared_storage_path", str(store)),),
            timing_dir=timing,
            prefix_caching=False,
            # vLLM's stats logger raises on the negative connector hit count ExampleConnector's loads
            # report (ValueError from prometheus_client) and takes the server down: no stats logging
            extra_args=(*extra, "--disable-log-stats"),
        ),
        root / "example-vllm.log",
    )
    try:
        base.start().wait_ready(300)

        async def example() -> None:
            http = httpx.AsyncClient()
            try:
                for n in sizes:
                    saves, loads = [], []
                    for _ in range(repeats):
                        p = _prompt(rng, n)
                        _clear(timing)
                        await _prefill_s(http, base.url, str(model), p)  # stores
                        saves += _timings(timing, "save")
                        _clear(timing)
                        # ExampleConnector finds stored KV for "the stored prompt + one generated token"
                        await _prefill_s(http, base.url, str(model), (*p, 5))  # loads
                        loads += _timings(timing, "load")
                    results[n]["example"] = {
                        "save_s": statistics.median(saves) if saves else None,
                        "load_s": statistics.median(loads) if loads else None,
                    }
            finally:
                await http.aclose()

        asyncio.run(example())
    finally:
        base.stop()
        shutil.rmtree(root, ignore_errors=True)
    bpt = 2 * 2 * 2 * 64 * (4 if dtype == "float32" else 2)  # layers x kv heads x (K, V) x head_dim x bytes
    for n, r in results.items():
        r["kv_bytes"] = -(-n // 32) * 32 * bpt
        ours_s = r["pddlink"]["save_s"] + r["pddlink"]["load_s"]
        ex = r["example"]
        ex_s = (ex["save_s"] or 0.0) + (ex["load_s"] or 0.0)
        r["pddlink"]["overhead_of_prefill"] = ours_s / r["prefill_s"]
        r["example"]["overhead_of_prefill"] = ex_s / r["prefill_s"]
        r["pddlink_vs_example"] = ours_s / ex_s if ex_s else None
    target = results.get(2048)
    return {
        "dtype": dtype,
        "repeats": repeats,
        "sizes": {str(n): r for n, r in results.items()},
        "target_2048": None
        if target is None
        else {
            "overhead_of_prefill": target["pddlink"]["overhead_of_prefill"],
            "max": 0.10,
            "below_example": target["pddlink_vs_example"] is not None and target["pddlink_vs_example"] < 1.0,
        },
    }
