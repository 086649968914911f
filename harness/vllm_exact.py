"""``pddlink bench vllm-exact``: PDD on vLLM against one vLLM alone, one request at a time, float32,
with a token-id handoff in every request (issue 13's exactness line).

The deployment: P, RelayDecode and MainDecode as vLLM servers beside their sidecars (``VllmTrio``,
``PositionSeededSampling`` loaded), MD across a netlab WAN (loopback lab, 200 Mbit/s, 10 ms RTT),
RLD on P's fast path. Every request goes P->RLD->MD (pipeline forced) and is made to hand off:

- the WAN from P to MD is cut for ``outage_s`` as the request starts, so MD can hold the prompt's KV
  only after RLD has streamed its first tokens (a handoff with nothing handed over would be P->MD
  under another name);
- the router reaches RLD through a lab of its own whose replies are slow (~6 KB/s of SSE, about 20
  tokens a second), MD directly: MD is always faster, so a catch-up ends with MD at RLD's position
  long before either could finish the answer (``max_tokens``).

Half the requests run with ``rld_capacity`` 1 (one request is a full RLD: one-shot, RLD's request is
aborted at once), half with 8 (a light RLD: catch-up, RLD streams until MD reaches its position).
In each half, greedy and seeded (temperature 0.8, top-p 0.95, a seed per request) alternate. The
prompts share a system prefix (``system_tokens``), so MD's DRC holds it after the first request and
only the rest crosses the WAN; each request's own part is fresh random tokens (40-400).

The reference: P's vLLM generating alone, after each request (no transfer params: the connector
stays out). Its prefix cache holds the prompt's whole blocks from P's own prefill of the request,
as RLD's and MD's loads do: every prompt token's KV was computed by that one prefill on all sides
(a multi-turn conversation would not give that: see ``cache_noise``).

JSON: requests, failed, token_mismatches, handed_off, tokens_from_both, by {greedy, seeded} x
{one_shot, catch_up}: requests / mismatches / handoffs, rld_tokens_before_handoff (mean, min, max),
divergences (position, the two tokens, vLLM alone's top-2 logprob gap there), held (what the
sidecars hold at the end: all 0 when nothing leaked), alone_cache_noise (``cache_noise``: how far
vLLM alone's own logprobs move with its prefix cache's state).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engines_adapter import SamplingParams
from harness.vllm_demo import divergence
from harness.vllm_demo_report import Done
from pddlink.errors import PddlinkError
from router.answer import RequestEnd

WAN_LINK = "[link]\ndelay_ms = 5\nrate_mbit = 200\nqueue_packets = 400\n"
RLD_LINK = "[link]\ndelay_ms = 0\n[b_to_a]\nrate_mbit = 0.05\n"  # RLD's replies to the router: slow
MODES = {"one_shot": 1, "catch_up": 8}  # handoff mode -> rld_capacity that makes one request pick it


@dataclass(frozen=True, slots=True)
class ExactSpec:
    requests: int = 50  # per sampling kind (greedy, seeded); split between the two handoff modes
    max_tokens: int = 200
    system_tokens: int = 64
    user_tokens: tuple[int, int] = (40, 400)
    outage_s: float = 1.0
    deadline_s: float = 60.0
    seed: int = 13


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def jobs(spec: ExactSpec) -> list[tuple[str, tuple[int, ...], SamplingParams]]:
    """(handoff mode, prompt, sampling) for every request, in the order they run."""
    rng = random.Random(spec.seed)
    system = [rng.randrange(3, 1000) for _ in range(spec.system_tokens)]
    out = []
    for i in range(2 * spec.requests):
        mode = "one_shot" if i < spec.requests else "catch_up"
        user = [rng.randrange(3, 1000) for _ in range(rng.randint(*spec.user_tokens))]
        sampling = (
            SamplingParams(max_tokens=spec.max_tokens)
            if i % 2 == 0
            else SamplingParams(seed=1000 + i, temperature=0.8, top_p=0.95, max_tokens=spec.max_tokens)
        )
        out.append((mode, (*system, *user), sampling))
    return out


async def _one(router: Any, prompt: tuple[int, ...], sampling: SamplingParams, deadline_s: float) -> Any:
    """(tokens, final event, positions in order without gap or duplicate)."""
    tokens: list[int] = []
    positions: list[int] = []
    final: dict[str, Any] = {}  # the final item as a document (``RequestEnd.to_dict``)
    async for ev in router.generate(list(prompt), sampling, pipeline="p_rld_md", deadline_s=deadline_s):
        if isinstance(ev, RequestEnd):
            final = ev.to_dict()
        else:
            tokens.append(ev.token_id)
            positions.append(ev.position)
    ordered = positions == list(range(len(prompt), len(prompt) + len(tokens)))
    return tokens, final, ordered


async def _replay(trio: Any, spec: ExactSpec, rld_url: str, wan_lab: Any) -> list[dict[str, Any]]:
    from router import Router, RouterConfig, VllmEngineConfig
    from router.vllm_legs import generate_alone

    model = str(trio.spec.model)
    rows: list[dict[str, Any]] = []
    todo = jobs(spec)
    async with httpx.AsyncClient(timeout=None) as http:
        for mode, capacity in MODES.items():
            v = VllmEngineConfig(
                p_url=trio.p.url, md_url=trio.md.url, rld_url=rld_url, model=model, rld_gets_kv=True
            )
            cfg = RouterConfig(
                engine="vllm",
                vllm=v,
                vocab_size=1024,
                recompute=False,
                line_mbit=200.0,
                rld_capacity=capacity,
                deadline_s=spec.deadline_s,
            )
            router = Router(cfg)
            await router.start()
            try:
                for i, (m, prompt, sampling) in enumerate(todo):
                    if m != mode:
                        continue
                    wan_lab.outage(spec.outage_s, direction="a_to_b")
                    rid = f"exact-{i}"
                    try:
                        tokens, final, ordered = await _one(router, prompt, sampling, spec.deadline_s)
                    except PddlinkError as exc:
                        tokens, final, ordered = [], {"outcome": "failed", "reason": exc.message}, True
                    alone = await generate_alone(http, trio.p.url, model, prompt, sampling)
                    row: dict[str, Any] = {
                        "request": rid,
                        "mode": mode,
                        "seeded": sampling.temperature > 0,
                        "outcome": final.get("outcome"),
                        "reason": final.get("reason"),
                        "ordered": ordered,
                        "trace": final.get("trace", {}),
                        "exact": tuple(tokens) == alone,
                    }
                    if final.get("outcome") == "finished" and not row["exact"]:
                        d = Done(rid, prompt, sampling, tuple(tokens), row["trace"])
                        row["divergence"] = await divergence(http, trio.p.url, model, d, alone)
                    rows.append(row)
                    n = len(rows)
                    if n % 10 == 0 or n == 2 * spec.requests:
                        bad = sum(not r["exact"] for r in rows)
                        say(f"  {n}/{2 * spec.requests} requests, {bad} not equal to vLLM alone")
            finally:
                await router.close()
    return rows


async def _top5(http: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> list[float]:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5}
    r = await http.post(url + "/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return sorted(r.json()["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)


async def _greedy(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = await http.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
    r.raise_for_status()
    return [int(t) for t in r.json()["choices"][0]["token_ids"]]


async def cache_noise(trio: Any, prompts: int = 5, n: int = 300, seed: int = 99) -> dict[str, Any]:
    """How far vLLM alone moves its own logprobs with where its cached KV came from. Fresh prompts
    on the three servers with no transfer params (the connector stays out); the largest |difference|
    of the top-5 logprobs of the next token between:

    - cold / cold: the prompt computed in one prefill on RLD's and on MD's server (two instances,
      the same computation);
    - cached prefix / cold: on P after a request for the prompt's first half (P's cache then holds
      4 whole blocks from that shorter prefill; the rest is computed as a chunk beside them);
    - decode-cached / prefill: RLD generates 96 tokens greedily after the prompt's first 200, so its
      cache holds those tokens' blocks as decode computed them; then prompt + those tokens + 32 more,
      on RLD (hitting them) against MD (prefilling them).

    A multi-turn conversation's earlier answers sit in vLLM alone's cache as decode computed them,
    where PDD's P prefilled them: the third figure is why such a turn can leave vLLM alone in a
    seeded draw with no handoff involved, where this benchmark's fresh prompts cannot."""
    model = str(trio.spec.model)
    rng = random.Random(seed)
    worst = {
        "cold_vs_cold_max_abs": 0.0,
        "cached_prefix_vs_cold_max_abs": 0.0,
        "decode_vs_prefill_max_abs": 0.0,
    }

    def note(key: str, a: list[float], b: list[float]) -> None:
        worst[key] = max(worst[key], *(abs(u - v) for u, v in zip(a, b, strict=True)))

    async with httpx.AsyncClient(timeout=None) as http:
        for _ in range(prompts):
            x = [rng.randrange(3, 1000) for _ in range(n)]
            a = await _top5(http, trio.rld.url, model, x)
            note("cold_vs_cold_max_abs", a, await _top5(http, trio.md.url, model, x))
            await _top5(http, trio.p.url, model, x[: n // 2])
            note("cached_prefix_vs_cold_max_abs", a, await _top5(http, trio.p.url, model, x))
            head = x[:200]
            answer = await _greedy(http, trio.rld.url, model, head, 96)
            y = [*head, *answer, *(rng.randrange(3, 1000) for _ in range(32))]
            note(
                "decode_vs_prefill_max_abs",
                await _top5(http, trio.rld.url, model, y),
                await _top5(http, trio.md.url, model, y),
            )
    return {"prompts": prompts, **worst}


def _held(trio: Any, timeout_s: float = 20.0) -> dict[str, dict[str, int]]:
    """What each sidecar holds (slots, bytes, transfers in flight): once it is nothing, or after
    ``timeout_s`` (the last request's RELEASE is sent without waiting)."""
    end = time.monotonic() + timeout_s
    while True:
        st = trio.status()
        held = {s: {k: int(st[s][k]) for k in ("held_slots", "held_bytes", "in_flight")} for s in st}
        if not any(any(v.values()) for v in held.values()) or time.monotonic() > end:
            return held
        time.sleep(0.25)


def report(spec: ExactSpec, rows: list[dict[str, Any]], held: dict[str, Any]) -> dict[str, Any]:
    """The JSON figures from the per-request rows (see the module docstring)."""
    by: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = f"{'seeded' if r['seeded'] else 'greedy'}/{r['mode']}"
        b = by.setdefault(key, {"requests": 0, "mismatches": 0, "handed_off": 0, "rld_tokens": []})
        t = r["trace"]
        b["requests"] += 1
        b["mismatches"] += int(r["outcome"] == "finished" and not r["exact"])
        # in the mode the request was set up for, with tokens to hand over (not "...:before_rld_first_token")
        handed = t.get("handoff_outcome") == "handed_off" and t.get("handoff_mode") == r["mode"]
        if r["outcome"] == "finished" and handed:
            b["handed_off"] += 1
            b["rld_tokens"].append(int(t.get("tokens", {}).get("rld", 0)))
    for b in by.values():
        xs = b.pop("rld_tokens")
        b["rld_tokens_before_handoff"] = (
            {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)} if xs else None
        )
    finished = [r for r in rows if r["outcome"] == "finished"]
    return {
        "engine": "vllm",
        "dtype": "float32",
        "one_at_a_time": True,
        "requests": len(rows),
        "greedy": sum(not r["seeded"] for r in rows),
        "seeded": sum(r["seeded"] for r in rows),
        "failed": len(rows) - len(finished),
        "failures": [f"{r['request']}: {r['reason']}" for r in rows if r["outcome"] != "finished"][:20],
        "token_mismatches": sum(not r["exact"] for r in finished),
        "out_of_order": sum(not r["ordered"] for r in rows),
        "handed_off": sum(b["handed_off"] for b in by.values()),
        "tokens_from_both": sum(set(r["trace"].get("tokens", {})) == {"rld", "md"} for r in finished),
        "by": dict(sorted(by.items())),
        "divergences": [r["divergence"] for r in rows if "divergence" in r],
        "held": held,
        "max_tokens": spec.max_tokens,
        "outage_s": spec.outage_s,
    }


def run(spec: ExactSpec) -> dict[str, Any]:
    import vllm.distributed.kv_events  # noqa: F401  (before the sidecars' loop imports it)

    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama
    from harness.vllm_trio import trio_across_lab
    from netlab import Lab
    from netlab.profile import parse_profile

    root = Path(tempfile.mkdtemp(prefix="pddlink-vx-"))  # sockets: keep the path short
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype="float32"))
    try:
        t0 = time.monotonic()
        with trio_across_lab(root / "w", model, WAN_LINK, "vxw") as trio:
            say(f"P, RLD and MD vLLM servers (float32) up in {time.monotonic() - t0:.1f} s")
            assert trio.rld is not None  # a trio starts RLD
            slow = Lab.up(
                parse_profile(RLD_LINK, name="vx-rld"), name=f"vxr{os.getpid() % 100000}", mode="loopback"
            )
            try:
                rld_url = "http://{}:{}".format(*slow.endpoint("dc-b", trio.rld.spec.port))
                try:
                    rows = asyncio.run(_replay(trio, spec, rld_url, trio.lab))  # type: ignore[attr-defined]
                finally:
                    trio.lab.set_outage(False)  # type: ignore[attr-defined]
                out = report(spec, rows, _held(trio))
                out["alone_cache_noise"] = asyncio.run(cache_noise(trio))
                return out
            finally:
                slow.down()
    finally:
        shutil.rmtree(root, ignore_errors=True)
