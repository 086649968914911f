"""``pddlink demo --engine vllm``: P and MD as vLLM servers beside their sidecars, across netlab.

What it does: builds the tiny random Llama (or serves ``--model``), brings a netlab WAN up
(loopback mode: the relay delays and rate-limits the TCP that P's sidecar opens to MD's KV port),
starts the ``VllmPair``, replays an agentic workload (sessions whose every turn re-sends the whole
conversation: a shared system prompt, earlier turns and MD's own answers, plus new user tokens)
P->MD through ``VllmDriver``, then checks every answer against P's vLLM generating alone (same
model, dtype, greedy; no connector involved). Figures (one JSON):

  requests, failed, token_mismatches, ttft_s {run: {p50, p90, p99}}, wan_bytes (KV bytes that
  crossed), wan_bytes_expected (sum of (prompt tokens - tokens MD's vLLM already held) x KV bytes
  per token), drc_hit_rate (prefix tokens MD's DRC reserved / prompt tokens),
  vllm_prefix_cache_hit_rate (vLLM's own counters on MD over the run), codec, engine = "vllm",
  held (what the sidecars hold at the end: slots, bytes, transfers: all 0 when nothing leaked).

Only whole blocks travel and MD recomputes the prompt's tail (< 1 block, see
``sidecar.vllm_kv.producer``), so wan_bytes falls short of wan_bytes_expected by that tail's KV
(``wan_tail_recomputed_bytes``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines_adapter.vllm.pair import PairSpec, VllmPair
from engines_adapter.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama
from netlab import Lab
from netlab.profile import parse_profile
from pddlink.errors import PddlinkError
from router.vllm_driver import DriveRequest, VllmDriver


@dataclass(frozen=True, slots=True)
class VllmDemoSpec:
    sessions: int = 10
    turns: int = 5
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (400, 800)
    max_tokens: int = 16
    dtype: str = "float32"
    model: Path | None = None  # a real model directory; None = the tiny random Llama
    line_mbit: float = 200.0
    rtt_ms: float = 20.0
    deadline_s: float = 60.0
    seed: int = 1
    extra_args: tuple[str, ...] = ()
    concurrent: bool = False


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pcts(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(xs)
    return {k: float(np.percentile(a, q)) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))}


def _prefix_counters(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))

    return total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")


async def _replay(pair: VllmPair, spec: VllmDemoSpec, model: str) -> dict[str, Any]:
    rng = random.Random(spec.seed)
    system = [rng.randrange(3, 1000) for _ in range(spec.system_tokens)]
    users = [
        [[rng.randrange(3, 1000) for _ in range(rng.randint(*spec.user_tokens))] for _ in range(spec.turns)]
        for _ in range(spec.sessions)
    ]
    driver = VllmDriver(pair.p.url, pair.md.url, model)  # type: ignore[union-attr]
    ttft: list[float] = []
    failed: list[str] = []
    done: list[tuple[DriveRequest, tuple[int, ...]]] = []

    async def session(s: int) -> None:
        history = list(system)
        for turn in range(spec.turns):
            history += users[s][turn]
            req = DriveRequest(tuple(history), spec.max_tokens, spec.deadline_s)
            try:
                got = await driver.run_p_md(req)
            except PddlinkError as exc:
                failed.append(f"{req.request_id}: {exc.message}")
                say(f"  request failed: {exc.message}")
                continue
            ttft.append(got.ttft_s)
            done.append((req, got.tokens))
            history += list(got.tokens)

    try:
        if spec.concurrent:  # every session at once (vLLM batches them: not batch-invariant on CPU)
            await asyncio.gather(*(session(s) for s in range(spec.sessions)))
        else:
            for s in range(spec.sessions):
                await session(s)
                say(f"  session {s + 1}/{spec.sessions}: {len(done)} done, {len(failed)} failed")
        divergences = []
        for req, tokens in done:  # P's vLLM alone: same model and dtype, greedy, no connector
            alone = await driver.generate_alone(pair.p.url, req)  # type: ignore[union-attr]
            if alone != tokens:
                divergences.append(await _divergence(driver, pair, model, req, alone, tokens))
    finally:
        await driver.close()
    return {"done": done, "failed": failed, "ttft": ttft, "divergences": divergences}


async def _divergence(
    driver: VllmDriver,
    pair: VllmPair,
    model: str,
    req: DriveRequest,
    alone: tuple[int, ...],
    got: tuple[int, ...],
) -> dict[str, Any]:
    """Where MD's answer left vLLM alone's, and the top-2 logprob gap vLLM alone had there."""
    i = next(k for k, (a, b) in enumerate(zip(alone, got, strict=False)) if a != b)
    body = {
        "model": model,
        "prompt": [*req.prompt, *alone[:i]],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 2,
    }
    r = await driver.http.post(pair.p.url + "/v1/completions", json=body, timeout=60)  # type: ignore[union-attr]
    top = sorted((r.json()["choices"][0]["logprobs"]["top_logprobs"][0] or {}).values(), reverse=True)
    gap = float(top[0] - top[1]) if len(top) >= 2 else None
    return {
        "request": req.request_id,
        "position": i,
        "alone": alone[i],
        "got": got[i],
        "top2_logprob_gap": gap,
    }


def run(spec: VllmDemoSpec, json_path: str | None) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="pddlink-vllm-demo-"))
    model = spec.model or build_tiny_llama(root / "model", TinyLlamaSpec(dtype=spec.dtype))
    profile = (
        f'description = "pddlink vLLM demo WAN: {spec.line_mbit:g} Mbit/s, {spec.rtt_ms:g} ms RTT"\n'
        f"[link]\ndelay_ms = {spec.rtt_ms / 2}\nrate_mbit = {spec.line_mbit}\nqueue_packets = 400\n"
    )
    t0 = time.monotonic()
    with Lab.up(
        parse_profile(profile, name="pddlink-vllm-demo"), name=f"vdemo{os.getpid() % 100000}", mode="loopback"
    ) as lab:
        wan = lambda port: "{}:{}".format(*lab.endpoint("dc-b", port))  # noqa: E731
        pair = VllmPair(
            PairSpec(
                root / "w",
                Path(model),
                dtype=spec.dtype,
                wan=wan,
                extra_args=spec.extra_args,
                wan_line_mbit=spec.line_mbit,
            )
        )
        try:
            pair.start()
            say(f"P and MD vLLM servers up in {time.monotonic() - t0:.1f} s ({lab.mode} lab)")
            q0, h0 = _prefix_counters(pair.md.url)  # type: ignore[union-attr]
            out = asyncio.run(_replay(pair, spec, str(model)))
            q1, h1 = _prefix_counters(pair.md.url)  # type: ignore[union-attr]
            time.sleep(0.5)
            status = pair.status()
            shipped = pair.loop.call(lambda: dict(pair.p_side.producer.done))  # type: ignore[union-attr]
            ends = pair.loop.call(lambda: dict(pair.md_side.consumer.finished))  # type: ignore[union-attr]
        finally:
            pair.close()
            if not os.environ.get("PDDLINK_KEEP_WORKDIR"):
                shutil.rmtree(root, ignore_errors=True)
    report = _report(spec, out, shipped, ends, status, (q1 - q0, h1 - h0))
    text = json.dumps(report, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    print(text)
    return report


def _report(
    spec: VllmDemoSpec,
    out: dict[str, Any],
    shipped: dict[str, dict[str, Any]],
    ends: dict[str, dict[str, Any]],
    status: dict[str, Any],
    prefix: tuple[float, float],
) -> dict[str, Any]:
    bs = 32
    wan = expected = padding = drc_tokens = prompt_tokens = wire = 0
    codecs: dict[str, int] = {}
    per_token = 0
    for req, _tokens in out["done"]:
        s, e = shipped.get(req.request_id, {}), ends.get(req.request_id, {})
        n = len(req.prompt)
        blocks = (n - 1) // bs - int(s.get("first_block", 0))
        if s.get("wan_bytes") and blocks:
            per_token = int(s["wan_bytes"]) // (blocks * bs)
        wan += int(s.get("wan_bytes", 0))
        wire += int(s.get("wire_bytes", s.get("wan_bytes", 0)))
        if s.get("codec"):
            codecs[str(s["codec"])] = codecs.get(str(s["codec"]), 0) + 1
        held = int(e.get("local_tokens") or 0)
        expected += (n - held) * per_token
        padding += (n - (n - 1) // bs * bs) * per_token  # the tail MD recomputes itself
        drc_tokens += int(s.get("first_block", 0)) * bs
        prompt_tokens += n
    queries, hits = prefix
    held_now = {
        side: {k: status[side][k] for k in ("held_slots", "held_bytes", "in_flight")} for side in status
    }
    return {
        "engine": "vllm",
        "dtype": spec.dtype,
        "requests": len(out["done"]) + len(out["failed"]),
        "failed": len(out["failed"]),
        "failures": out["failed"][:20],
        "token_mismatches": len(out["divergences"]),
        "divergences": out["divergences"],
        "concurrent": spec.concurrent,
        "ttft_s": {"baseline": _pcts(out["ttft"])},
        "wan_bytes": wan,
        "wan_bytes_expected": expected,
        "wan_tail_recomputed_bytes": padding,
        "drc_hit_rate": drc_tokens / prompt_tokens if prompt_tokens else 0.0,
        "vllm_prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "codec": {
            "name": max(codecs, key=lambda c: codecs[c]) if codecs else "raw",
            "ratio": round(wan / wire, 3) if wire else 1.0,
            "bytes_saved": wan - wire,
            "transfers": codecs,
        },
        "held": held_now,
        "md": status.get("md", {}),
        "p": status.get("p", {}),
        "line_mbit": spec.line_mbit,
        "rtt_ms": spec.rtt_ms,
    }
