"""``pddlink demo --engine vllm``: P and MD as vLLM servers beside their sidecars, across netlab.

What it does: builds the tiny random Llama (or serves ``--model``), brings a netlab WAN up
(loopback mode: the relay delays and rate-limits the TCP that P's sidecar opens to MD's KV port),
starts P, RLD and MD (``VllmPair(relay=True)``) and replays an agentic workload (sessions whose
every turn re-sends the whole conversation: a shared system prompt, earlier turns and the answers,
plus new user tokens) through the ``Router`` (``engine = "vllm"``, ``router.vllm_legs``): first as
the P->MD baseline (pipeline forced), then as PDD (the router's own choice per request; a workload
of the same shape with other tokens, so MD's cache holds none of it). Every answer is checked
against P's vLLM generating alone (same model, dtype and sampling; greedy, and seeded sampling at
temperature 0.8, top-p 0.95 in odd sessions through ``PositionSeededSampling``; no connector
involved). Then a short bfloat16 P->MD phase on its own P and MD: its KV crosses with the byte-plane
codec (float32 KV compresses only ~1.19x losslessly), reported as the top-level ``codec``.

The WAN: 16 Mbit/s, 20 ms RTT by default. The tiny model's KV is 2 KB per token in float32, about
1/160 of a 70B-class model's (~320 KB per token in bf16), so 16 Mbit/s here is ~2.6 Gbit/s for such a
model: the published regime (a 10-100 Gbit/s line shared by many flows, "seconds to ship a low-hit
request's KV"), where shipping a turn's new ~600 tokens (~1.2 MB, ~0.6 s) dominates P's prefill
(tens of ms). Figures (one JSON):

  requests, failed, token_mismatches, ttft_s {run: {p50, p90, p99}}, wan_bytes (KV bytes that
  crossed), wan_bytes_expected (sum of (prompt tokens - tokens MD's vLLM already held) x KV bytes
  per token), drc_hit_rate (prefix tokens MD's DRC reserved / prompt tokens),
  vllm_prefix_cache_hit_rate (vLLM's own counters on MD over the run), codec, engine = "vllm",
  held (what the sidecars hold at the end: slots, bytes, transfers: all 0 when nothing leaked);
  with PDD: ttft_s {baseline, pdd}, p90_ratio, handoffs {one_shot, catch_up}, tokens {rld, md},
  rld_token_share, pdd {...}, ttft_stages {stage: median s}, router_ttft_share and
  ttft_stages_detail (where the PDD phase's TTFT goes, ``harness.ttft_stages``: the router's own
  stamps, P's transfer records, vLLM's queue/prefill histograms and the connectors' hook timings);
  bfloat16 {divergences with vLLM alone's top-2 logprob gap, ...}.
  The connector figures (wan_bytes, drc_hit_rate, ...) are the baseline's; token_mismatches counts
  both float32 runs.

The workload's pace (measured, PDD phase): sessions two at a time, staggered by ``stagger_s``, with
``think_s`` between a session's turns (the agent's own step), answers of ``max_tokens`` = 128. A
relayed turn that RLD finishes still ships its KV to MD (``router.vllm_legs``: the prime outlives the
run), so MD holds each conversation and the next turn ships only its new ~600 tokens (~0.5 s): RLD
is still streaming then, and MD takes over (one-shot when both sessions' requests are on RLD,
catch-up when one is). With 16-token answers RLD had finished every request before MD's KV landed
(0 handoffs); with back-to-back turns the WAN never caught up with the history.

One machine stands in for several, so the servers are pinned (``PairSpec.pin_cores``, both runs
alike): P's vLLM on one half of the cores, RLD's and MD's on the other, as P would run on machines
of its own. Unpinned, P's prefill ran beside the other session's RLD/MD decoding on 2 shared cores
(``prefill_seconds`` P90 0.47 s in PDD against 0.19 s in the baseline) and PDD's TTFT P90 came out
at 0.7-1.07x the baseline's; pinned, 0.39x (one run, 100 requests, 0 failed, 9 one-shot and 13
catch-up handoffs). RLD's own part of TTFT stays ~0.03-0.1 s. P ships RLD only what RLD's own DRC
lacks (``pdd.fast_path``: bytes against every whole block). Per request: ``pdd.per_request`` and
``pdd.ttft_s_by_handoff``; each server's cores: ``cores``.

Only whole blocks travel and MD recomputes the prompt's tail (< 1 block, see
``sidecar.vllm_kv.producer``), so wan_bytes falls short of wan_bytes_expected by that tail's KV
(``wan_tail_recomputed_bytes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from engines_adapter import SamplingParams
from harness.demo_report import plot
from harness.ttft_stages import VLLM_ARGS, EngineSide, RequestTimes, stage_table
from harness.vllm import SEEDED_SAMPLING
from harness.vllm.pair import PairSpec, VllmPair
from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama
from harness.vllm_demo_report import Done, fast_path_report, pdd_report, run_report, table
from netlab import Lab
from netlab.profile import parse_profile
from pddlink.errors import PddlinkError
from router import Router, RouterConfig, VllmEngineConfig
from router.answer import RequestEnd
from router.vllm_legs import generate_alone


@dataclass(frozen=True, slots=True)
class VllmDemoSpec:
    sessions: int = 10
    turns: int = 5
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (400, 800)
    max_tokens: int = 128
    dtype: str = "float32"
    model: Path | None = None  # a real model directory; None = the tiny random Llama
    line_mbit: float = 16.0  # see run(): the WAN transfer dominates TTFT, as in the published regime
    rtt_ms: float = 20.0
    deadline_s: float = 60.0
    seed: int = 1
    extra_args: tuple[str, ...] = ()
    concurrent: bool = False
    seeded: bool = True  # odd sessions sample (seed, temperature 0.8, top-p 0.95)
    pdd: bool = True  # after the P->MD baseline, PDD on P + RLD + MD
    parallel: int = 2  # sessions replayed at once (RLD's load, hence the handoff kind, varies)
    think_s: float = 1.0  # between a session's turns: the agent's own step (a tool call) before it asks again
    stagger_s: float = 0.7  # the sessions of a group start this far apart (they do not arrive in lockstep)
    bf16_sessions: int = 4  # the short bfloat16 P->MD phase (its KV crosses with the byte-plane codec)
    pin_cores: bool = True  # P's vLLM on half the cores, RLD's and MD's on the other (PairSpec.pin_cores)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prefix_counters(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))

    return total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")


def _workload(spec: VllmDemoSpec) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(spec.seed)
    system = [rng.randrange(3, 1000) for _ in range(spec.system_tokens)]
    users = [
        [[rng.randrange(3, 1000) for _ in range(rng.randint(*spec.user_tokens))] for _ in range(spec.turns)]
        for _ in range(spec.sessions)
    ]
    return system, users


def router_config(
    urls: dict[str, str], model: str, spec: VllmDemoSpec, *, relay: bool, rld_gets_kv: bool = False
) -> RouterConfig:
    """The router in front of the demo's vLLM servers (``router.vllm_legs``). KV bytes per token:
    the tiny Llama's (2 layers x K,V x 2 heads x 64 x 4 bytes in float32)."""
    v = VllmEngineConfig(
        p_url=urls["p"],
        md_url=urls["md"],
        rld_url=urls.get("rld", ""),
        model=model,
        rld_gets_kv=rld_gets_kv,
        md_kv_events=urls.get("md_kv_events", ""),
    )
    return RouterConfig(
        engine="vllm",
        vllm=v,
        vocab_size=1024,
        line_mbit=spec.line_mbit,
        rtt_ms=spec.rtt_ms,
        deadline_s=spec.deadline_s,
        relay_enabled=relay and bool(urls.get("rld")),
        kv_bytes_per_token=2048 if spec.dtype == "float32" else 1024,
        rld_capacity=3,  # two sessions at once: one relayed request = load 0.33 (catch-up), two = 0.67
        singular_max_tokens=1,  # the demo's answers are long: never singular
        recompute=False,  # PDD as published: relay, not MD prefilling a missing suffix itself
    )


def sampling_of(spec: VllmDemoSpec, session: int, turn: int) -> SamplingParams:
    """Greedy, or (``spec.seeded``: odd sessions) seeded sampling at temperature 0.8, top-p 0.95."""
    if spec.seeded and session % 2 == 1:
        return SamplingParams(
            seed=1000 * session + turn, temperature=0.8, top_p=0.95, max_tokens=spec.max_tokens
        )
    return SamplingParams(max_tokens=spec.max_tokens)


async def _replay(
    cfg: RouterConfig,
    spec: VllmDemoSpec,
    pipeline: str,
    alone_url: str,
    label: str,
    after_sessions: Callable[[], Any] | None = None,
    connect: Callable[[RouterConfig], Any] = Router,
) -> dict[str, Any]:
    """Every session's turns through the Router (``pipeline`` forced, or "" for the router's own
    choice), then every answer against ``alone_url``'s vLLM generating alone (``after_sessions``,
    if given, runs in between: what it reads is the sessions' alone). ``connect``: the router for
    ``cfg`` (in this process, or the compose lab's router container)."""
    system, users = _workload(spec)
    router = connect(cfg)
    await router.start()
    ttft: list[float] = []
    failed: list[str] = []
    done: list[Done] = []
    run_t0 = time.monotonic()

    async def session(s: int) -> None:
        await asyncio.sleep(spec.stagger_s * (s % spec.parallel))
        history = list(system)
        for turn in range(spec.turns):
            history += users[s][turn]
            rid = f"{label}-{s}-{turn}-{time.time_ns() % 10**9}"
            sampling = sampling_of(spec, s, turn)
            tokens: list[int] = []
            final: RequestEnd | None = None
            sent = time.monotonic()
            first: float | None = None
            try:
                async for ev in router.generate(
                    history,
                    sampling,
                    deadline_s=spec.deadline_s,
                    pipeline=pipeline,
                    request_id=rid,
                    arrived=sent,
                ):
                    if isinstance(ev, RequestEnd):
                        final = ev
                    else:
                        first = time.monotonic() if first is None else first
                        tokens.append(ev.token_id)
            except PddlinkError as exc:
                failed.append(f"{rid}: {exc.message}")
                continue
            if final is None or not final.finished:
                why = final.reason if final is not None else None
                failed.append(f"{rid}: {why}")
                say(f"  request failed: {why}")
                continue
            trace = dict(final.trace)
            ttft.append(float(trace["ttft_s"]))
            client_ttft = None if first is None else first - sent
            done.append(Done(rid, tuple(history), sampling, tuple(tokens), trace, sent - run_t0, client_ttft))
            history += tokens
            await asyncio.sleep(spec.think_s)

    divergences = []
    try:
        if spec.concurrent:  # every session at once (vLLM batches them: not batch-invariant on CPU)
            await asyncio.gather(*(session(s) for s in range(spec.sessions)))
        else:  # ``parallel`` sessions at a time
            for s0 in range(0, spec.sessions, spec.parallel):
                group = range(s0, min(s0 + spec.parallel, spec.sessions))
                await asyncio.gather(*(session(s) for s in group))
                n = group[-1] + 1
                say(f"  {label} sessions {n}/{spec.sessions}: {len(done)} done, {len(failed)} failed")
        if after_sessions is not None:
            await asyncio.to_thread(after_sessions)
        async with httpx.AsyncClient(timeout=None) as http:
            for d in done:  # one vLLM alone: same model and dtype, same sampling, no connector
                alone = await generate_alone(http, alone_url, cfg.vllm.model, d.prompt, d.sampling)
                if alone != d.tokens:
                    divergences.append(await divergence(http, alone_url, cfg.vllm.model, d, alone))
    finally:
        await router.close()
    return {"done": done, "failed": failed, "ttft": ttft, "divergences": divergences}


async def divergence(
    http: httpx.AsyncClient, url: str, model: str, d: Done, alone: tuple[int, ...]
) -> dict[str, Any]:
    """Where the router's answer left vLLM alone's, and the top-2 logprob gap vLLM alone had there."""
    got = d.tokens
    i = next(
        (k for k, (a, b) in enumerate(zip(alone, got, strict=False)) if a != b), min(len(alone), len(got))
    )
    body = {
        "model": model,
        "prompt": [*d.prompt, *alone[:i]],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 2,
    }
    r = await http.post(url + "/v1/completions", json=body, timeout=60)
    top = sorted((r.json()["choices"][0]["logprobs"]["top_logprobs"][0] or {}).values(), reverse=True)
    gap = float(top[0] - top[1]) if len(top) >= 2 else None
    return {
        "request": d.request_id,
        "position": i,
        "alone": alone[i] if i < len(alone) else None,
        "got": got[i] if i < len(got) else None,
        "top2_logprob_gap": gap,
        "pipeline": d.trace.get("pipeline"),
        "seeded": d.sampling.temperature > 0,
    }


def room_args() -> tuple[str, ...]:
    """Five turns of up to 800 new tokens and 128-token answers outgrow vLLM's default 4096."""
    return ("--max-model-len", "8192", "--max-num-batched-tokens", "8192")


def _start(spec: VllmDemoSpec, workdir: Path, model: Path, dtype: str, wan: Any, relay: bool) -> VllmPair:
    # MD's sidecar imports vLLM's event types on its loop's thread when its KV-event feed starts:
    # on a loaded machine that import outlasts the pair's 60 s wait for the sidecar; import it here
    import vllm.distributed.kv_events  # noqa: F401

    extra = ("--logits-processors", SEEDED_SAMPLING, *room_args(), *VLLM_ARGS, *spec.extra_args)
    (workdir / "timings").mkdir(parents=True, exist_ok=True)  # the connectors' hook timings (TTFT stages)
    pair = VllmPair(
        PairSpec(
            workdir,
            model,
            dtype=dtype,
            wan=wan,
            extra_args=extra,
            wan_line_mbit=spec.line_mbit,
            relay=relay,
            pin_cores=spec.pin_cores,
            timing_dir=workdir / "timings",
        )
    )
    t0 = time.monotonic()
    pair.start()
    roles = "P, RLD and MD" if relay else "P and MD"
    pinned = ", ".join(f"{k} on {list(v)}" for k, v in pair.cores.items()) or "not pinned"
    say(f"{roles} vLLM servers ({dtype}) up in {time.monotonic() - t0:.1f} s (cores: {pinned})")
    return pair


def _records(pair: VllmPair) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    # P's last shipments (a relayed turn that RLD finished still ships its KV to MD, for the next
    # turn) and MD's last releases: each ends within its request's deadline
    end = time.monotonic() + 20.0
    time.sleep(0.5)
    while any(st["in_flight"] for st in pair.status().values()) and time.monotonic() < end:
        time.sleep(0.25)
    status = pair.status()
    shipped = pair.shipped_all()
    ends = pair.finished()
    return status, shipped, ends


Readings = dict[str, tuple[str, int]]  # role -> (its /metrics text, its hook-timing file's size)


def _engine_readings(pair: VllmPair) -> Readings:
    """Each vLLM server's /metrics text and how far its connector's hook-timing file has grown."""
    out: Readings = {}
    for role, server in pair.servers().items():
        text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
        path = _timing_file(pair, role)
        out[role] = (text, path.stat().st_size if path.exists() else 0)
    return out


def _timing_file(pair: VllmPair, role: str) -> Path:
    assert pair.spec.timing_dir is not None
    kind = "kv_producer" if role == "p" else "kv_consumer"
    return pair.spec.timing_dir / f"{kind}-{pair.servers()[role].spec.port}.jsonl"


def _engine_side(pair: VllmPair, before: Readings, after: Readings) -> EngineSide:
    """vLLM's and the connectors' readings between ``before`` and ``after`` (``harness.ttft_stages``)."""
    hooks: dict[str, list[str]] = {}
    for role in after:
        if not _timing_file(pair, role).exists():
            hooks[role] = []
            continue
        with _timing_file(pair, role).open("rb") as f:
            f.seek(before[role][1])
            hooks[role] = f.read(after[role][1] - before[role][1]).decode().splitlines()
    metrics = {role: (before[role][0], after[role][0]) for role in after}
    return EngineSide.of(metrics, hooks)


def _urls(pair: VllmPair) -> dict[str, str]:
    urls = {"p": pair.p.url, "md": pair.md.url, "md_kv_events": pair.md_kv_events}  # type: ignore[union-attr]
    if pair.rld is not None:
        urls["rld"] = pair.rld.url
    return urls


Start = Callable[[Path, Path, str, bool], Any]  # (workdir, model, dtype, relay) -> a started pair


def _float32_runs(spec: VllmDemoSpec, root: Path, model: Path, start: Start) -> dict[str, Any]:
    """P->MD baseline, then PDD (router's own choice) on one P+RLD+MD deployment; the two runs replay
    workloads of the same shape with different tokens (so PDD does not find the baseline's prompts
    in MD's cache)."""
    pair = start(root / "f32", model, spec.dtype, spec.pdd)
    connect = getattr(pair, "connect_router", Router)  # the compose lab's router container
    try:
        urls = _urls(pair)
        p_url, md_url = urls["p"], urls["md"]
        rld = spec.pdd and "rld" in urls
        q0, h0 = _prefix_counters(md_url)
        name = getattr(pair, "model_name", str(model))  # what the servers serve (their --model)
        cfg = router_config(urls, name, spec, relay=False, rld_gets_kv=rld)
        base = asyncio.run(_replay(cfg, spec, "p_md", p_url, "baseline", connect=connect))
        q1, h1 = _prefix_counters(md_url)
        status, shipped, ends = _records(pair)
        out: dict[str, Any] = {
            "baseline": base,
            "records": (status, shipped, ends),
            "prefix": (q1 - q0, h1 - h0),
            "cores": {k: list(v) for k, v in pair.cores.items()},
        }
        if rld:
            pdd_spec = replace(spec, seed=spec.seed + 1)
            cfg = router_config(urls, name, spec, relay=True, rld_gets_kv=True)
            out["pdd_status_before"] = pair.status()
            before = _engine_readings(pair)
            after: Readings = {}
            readings = lambda: after.update(_engine_readings(pair))  # noqa: E731
            out["pdd"] = asyncio.run(_replay(cfg, pdd_spec, "", p_url, "pdd", readings, connect))
            out["pdd_status"], out["pdd_shipped"], _ = _records(pair)
            out["pdd_engine"] = _engine_side(pair, before, after)
        return out
    finally:
        pair.close()


def _bf16_run(spec: VllmDemoSpec, root: Path, start: Start) -> dict[str, Any]:
    """A short bfloat16 P->MD phase: its KV crosses with the byte-plane codec."""
    model = build_tiny_llama(root / "model-bf16", TinyLlamaSpec(dtype="bfloat16"))
    pair = start(root / "bf16", model, "bfloat16", False)
    try:
        urls = _urls(pair)
        bspec = replace(spec, sessions=spec.bf16_sessions, seed=spec.seed + 2, dtype="bfloat16")
        cfg = router_config(urls, getattr(pair, "model_name", str(model)), bspec, relay=False)
        connect = getattr(pair, "connect_router", Router)
        out = asyncio.run(_replay(cfg, bspec, "p_md", urls["p"], "bf16", connect=connect))
        status, shipped, ends = _records(pair)
        return {"run": out, "records": (status, shipped, ends), "spec": bspec}
    finally:
        pair.close()


def _stages(pdd: dict[str, Any], shipped: dict[str, dict[str, Any]], engine: EngineSide) -> dict[str, Any]:
    """The PDD phase's TTFT stage table (``harness.ttft_stages``)."""
    times = [
        RequestTimes.of(d.trace, d.client_ttft_s, shipped.get(d.trace.get("request_key", ""), {}))
        for d in pdd["done"]
        if d.client_ttft_s is not None
    ]
    return stage_table([t for t in times if t is not None], engine)


@contextlib.contextmanager
def _lab(spec: VllmDemoSpec, profile: str, kind: str, figures: dict[str, Any]) -> Iterator[Start]:
    """The WAN and how the deployments start on it: netlab's loopback relay and processes here, or
    the compose lab's containers (``harness.vllm_compose``)."""
    if kind == "compose":
        from harness.vllm_compose import compose_lab, compose_start

        with compose_lab(spec, profile, say, figures) as lab:
            yield compose_start(lab, spec)
        return
    with Lab.up(parse_profile(profile, name="pddlink-vllm-demo"), name=f"vdemo{os.getpid() % 100000}",
                mode="loopback") as lab:  # fmt: skip
        wan = lambda port: "{}:{}".format(*lab.endpoint("dc-b", port))  # noqa: E731
        yield lambda workdir, model, dtype, relay: _start(spec, workdir, model, dtype, wan, relay)


def run(spec: VllmDemoSpec, json_path: str | None, lab_kind: str = "loopback") -> dict[str, Any]:
    """``lab_kind`` "compose": every role in a container of the compose lab (``harness.vllm_compose``)."""
    root = Path(tempfile.mkdtemp(prefix="pddlink-vllm-demo-"))
    model = spec.model or build_tiny_llama(root / "model", TinyLlamaSpec(dtype=spec.dtype))
    profile = (
        f'description = "pddlink vLLM demo WAN: {spec.line_mbit:g} Mbit/s, {spec.rtt_ms:g} ms RTT"\n'
        f"[link]\ndelay_ms = {spec.rtt_ms / 2}\nrate_mbit = {spec.line_mbit}\nqueue_packets = 400\n"
    )
    lab_figures: dict[str, Any] = {}
    try:
        with _lab(spec, profile, lab_kind, lab_figures) as start:
            f32 = _float32_runs(spec, root, Path(model), start)
            bf16 = _bf16_run(spec, root, start) if spec.bf16_sessions and spec.model is None else None
    finally:
        if not os.environ.get("PDDLINK_KEEP_WORKDIR"):
            shutil.rmtree(root, ignore_errors=True)
    status, shipped, ends = f32["records"]
    report = run_report(spec, f32["baseline"], shipped, ends, status, f32["prefix"])
    report.update(lab_figures)  # compose: the lab, its images
    report["cores"] = f32["cores"]  # each vLLM server's cores ({} = not pinned), both float32 runs
    if "pdd" in f32:
        report.update(pdd_report(f32["baseline"], f32["pdd"], f32["pdd_status"]))
        report["pdd"]["fast_path"] = fast_path_report(f32["pdd"], f32["pdd_status_before"], f32["pdd_status"])
        report["requests"] += report["pdd"]["requests"]
        report["failed"] += report["pdd"]["failed"]
        report["token_mismatches"] += report["pdd"]["token_mismatches"]  # both float32 runs
        report.update(_stages(f32["pdd"], f32["pdd_shipped"], f32["pdd_engine"]))
    if bf16 is not None:
        bstatus, bshipped, bends = bf16["records"]
        b = run_report(bf16["spec"], bf16["run"], bshipped, bends, bstatus, (0.0, 0.0))
        report["codec_float32"] = report["codec"]
        report["codec"] = {**b["codec"], "dtype": "bfloat16"}
        report["bfloat16"] = {
            "requests": b["requests"],
            "failed": b["failed"],
            "token_mismatches": b["token_mismatches"],
            "divergences": b["divergences"],  # each with vLLM alone's top-2 logprob gap there
            "wan_bytes": b["wan_bytes"],
            "wan_bytes_expected": b["wan_bytes_expected"],
            "codec": report["codec"],
            "held": b["held"],
        }
        report["failed"] += b["failed"]
    text = json.dumps(report, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
        if "pdd" in f32:
            plot(
                {"ttft_values": f32["baseline"]["ttft"]},
                {"ttft_values": f32["pdd"]["ttft"]},
                Path(json_path).with_suffix(".png"),
            )
    print(text)
    say(table(report))
    return report
