"""``pddlink bench vllm``: the connector's own cost against P's prefill, and against vLLM's
``ExampleConnector``, in one run, for prompts of 512, 2048 and 8192 tokens.

Both connectors are timed by one clock at the same boundaries (``engines_adapter.vllm.hook_timing``):
the time vLLM spends inside the connector's hooks, which is what it waits on.

Per size (``--repeats`` distinct random prompts each, median reported):
  prefill_s      P's vLLM prefilling the prompt alone (max_tokens 1, no prefix hit, no connector
                 work: a request without kv_transfer_params), end to end over HTTP
  kv_bytes       the KV of the prompt's blocks; kv_bytes_moved: of its whole blocks below the last
                 token, what either connector moves (the last block is recomputed on the consumer)
  pddlink        out_s (P): every worker hook of the step that hands the request's KV out
                 (``save_s``: ALLOC sent before the forward, its answer read after it, the copy out
                 of the paged cache into the shared-memory slot, COMMIT sent) plus the request's
                 scheduler hooks (``save_sched_s``: PREPARE sent, metadata);
                 in_s (MD): every worker hook of the steps that take it in (``load_s``: the load
                 noted, POLL, the copy from the landing slot into vLLM's blocks, RELEASE sent) plus
                 the request's scheduler hooks (``load_sched_s``: the POLL that learns where the
                 transfer starts, RELEASE at the end). The wire is excluded: the steps in which MD
                 only polls while the KV is still crossing are ``poll_idle_s``, not part of in_s;
                 phases (``save_phases``: alloc_send_s, alloc_s, copy_s, commit_s, the copy path;
                 ``load_copy_s``) and each hook's time are reported
  example        the same for vLLM's ExampleConnector (safetensors files in a temp dir) on one vLLM
                 with prefix caching off: out_s for the request that stores the prompt's KV, in_s
                 for the same prompt sent again, which loads it (synchronously, before its forward);
                 ``load_errors`` counts loads that failed (then nothing was loaded)
  overhead_of_prefill = (out_s + in_s) / prefill_s; pddlink_vs_example = ours / ExampleConnector's
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from harness.vllm.pair import PairSpec, VllmPair, free_port
from harness.vllm.server import VllmServer, VllmServerSpec
from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama
from router.vllm_driver import DriveRequest, VllmDriver

SIZES = (512, 2048, 8192)


def _records(d: Path, role: str = "") -> list[dict[str, Any]]:
    """The timing records in ``d`` (of the servers whose kv_role starts with ``role``)."""
    out = []
    for f in sorted(d.glob(f"{role}*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines()]
    return out


def _side(recs: list[dict[str, Any]], op: str) -> dict[str, Any]:
    """One request's side: its worker records of ``op``, summed, and its scheduler record."""
    work = [r for r in recs if op in str(r["op"]).split("+")]
    sched = [r for r in recs if r["op"] == "sched"]
    hooks: dict[str, float] = {}
    for r in work:
        for k, v in r["hooks"].items():
            hooks[k] = hooks.get(k, 0.0) + v
    skip = ("op", "seconds", "hooks", "idle_s", "idle_steps", "cpu_s")
    notes = {k: v for r in work for k, v in r.items() if k not in skip}
    worker_s = sum(float(r["seconds"]) for r in work)
    sched_s = sum(float(r["seconds"]) for r in sched)
    return {
        "records": len(work),
        "worker_s": worker_s,
        "sched_s": sched_s,
        "total_s": worker_s + sched_s,
        "cpu_s": sum(float(r.get("cpu_s", 0.0)) for r in work + sched),
        "idle_s": sum(float(r.get("idle_s", 0.0)) for r in work),
        "hooks": hooks,
        "notes": notes,
    }


async def _settled(
    d: Path, want: Mapping[str, tuple[str, ...]], timeout_s: float = 5.0
) -> list[dict[str, Any]]:
    """Wait (bounded) until each role's file holds the ops wanted, then return its records."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok = all(
            all(any(op in str(r["op"]).split("+") for r in _records(d, role)) for op in ops)
            for role, ops in want.items()
        )
        if ok or time.monotonic() > deadline:
            return _records(d)
        await asyncio.sleep(0.05)


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _hooks_median(sides: list[dict[str, Any]]) -> dict[str, float]:
    names = sorted({k for s in sides for k in s["hooks"]})
    return {k: statistics.median(s["hooks"].get(k, 0.0) for s in sides) for k in names}


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


def _summary(outs: list[dict[str, Any]], ins: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one connector's out (P / store) and in (MD / load) sides."""

    def med(sides: list[dict[str, Any]], key: str) -> float:
        return statistics.median(float(s[key]) for s in sides) if sides else 0.0

    def notes(sides: list[dict[str, Any]]) -> dict[str, Any]:
        keys = sorted({k for s in sides for k, v in s["notes"].items() if isinstance(v, (int, float))})
        out: dict[str, Any] = {
            k: statistics.median(float(s["notes"].get(k, 0.0)) for s in sides) for k in keys
        }
        paths = sorted({str(s["notes"]["path"]) for s in sides if "path" in s["notes"]})
        if paths:
            out["path"] = paths
        return out

    return {
        "out_s": med(outs, "total_s"),
        "in_s": med(ins, "total_s"),
        "save_s": med(outs, "worker_s"),
        "save_sched_s": med(outs, "sched_s"),
        "load_s": med(ins, "worker_s"),
        "load_sched_s": med(ins, "sched_s"),
        "poll_idle_s": med(ins, "idle_s"),
        "out_cpu_s": med(outs, "cpu_s"),  # the hooks' thread CPU time: out_s minus it was off CPU
        "in_cpu_s": med(ins, "cpu_s"),
        "save_phases": notes(outs),
        "load_phases": notes(ins),
        "save_hooks": _hooks_median(outs),
        "load_hooks": _hooks_median(ins),
        "out_s_all": [s["total_s"] for s in outs],
        "in_s_all": [s["total_s"] for s in ins],
        "missing": sum(s["records"] == 0 for s in outs + ins),  # a side that wrote no record
    }


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
                    outs: list[dict[str, Any]] = []
                    ins: list[dict[str, Any]] = []
                    for _ in range(repeats):
                        pre.append(await _prefill_s(http, pair.p.url, str(model), _prompt(rng, n)))
                        _clear(timing)
                        await driver.run_p_md(DriveRequest(_prompt(rng, n), 1, 120.0))
                        want = {"kv_producer": ("save", "sched"), "kv_consumer": ("load", "sched")}
                        await _settled(timing, want)
                        outs.append(_side(_records(timing, "kv_producer"), "save"))
                        ins.append(_side(_records(timing, "kv_consumer"), "load"))
                    results[n]["prefill_s"] = statistics.median(pre)
                    results[n]["pddlink"] = _summary(outs, ins)
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
            kv_connector_module="harness.vllm.timed_example",
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
                    outs, ins = [], []
                    for _ in range(repeats):
                        p = _prompt(rng, n)
                        _clear(timing)
                        await _prefill_s(http, base.url, str(model), p)  # stores
                        outs.append(_side(await _settled(timing, {"kv_both": ("save", "sched")}), "save"))
                        _clear(timing)
                        await _prefill_s(http, base.url, str(model), p)  # the same prompt: loads
                        ins.append(_side(await _settled(timing, {"kv_both": ("load", "sched")}), "load"))
                    results[n]["example"] = _summary(outs, ins)
                    results[n]["example"]["load_errors"] = sum("load_error" in i["notes"] for i in ins)
            finally:
                await http.aclose()

        asyncio.run(example())
    finally:
        base.stop()
        shutil.rmtree(root, ignore_errors=True)
    bpt = 2 * 2 * 2 * 64 * (4 if dtype == "float32" else 2)  # layers x kv heads x (K, V) x head_dim x bytes
    for n, r in results.items():
        r["kv_bytes"] = (n - 1) // 32 * 32 * bpt
        ours_s, ex_s = (
            r["pddlink"]["out_s"] + r["pddlink"]["in_s"],
            r["example"]["out_s"] + r["example"]["in_s"],
        )
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
