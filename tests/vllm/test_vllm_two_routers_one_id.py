"""Two routers (both named ``router0``) in front of the same vLLM trio -- P, RelayDecode and MD as
vLLM servers beside their pddlink sidecars, MD across a loopback netlab WAN -- sent the same
client ``request_id`` at once with different prompts (issue 25, item 3, on vLLM).

vLLM's own request ids are its own (the router sends none: each server makes one per HTTP
request); what the sidecars and the connector key a transfer by is the ``transfer`` of
``kv_transfer_params``, the router's request key. Every answer is exact (one vLLM generating the
same prompt alone; float32, ``PositionSeededSampling``) or refused typed, none hangs, the two
answers of a pair carry two keys and one label, and nothing is held afterwards.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.answer import RequestEnd

pytestmark = [pytest.mark.fleet, pytest.mark.vllm, pytest.mark.netlab, pytest.mark.timeout(1500)]

PAIRS = 100
WAVE = 4  # pairs at once: 8 requests over the two routers
DEADLINE_S = 60.0
HUNG_S = 0.8 * DEADLINE_S
PIPELINES = ("", "p_md", "p_rld_md", "singular")


@pytest.fixture(scope="module")
def trio(tiny_llama_f32: Path) -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    import vllm.distributed.kv_events  # noqa: F401  (before the sidecars' loop imports it)

    from harness.vllm_trio import trio_across_lab

    root = Path(tempfile.mkdtemp(prefix="pddlink-v2r-"))  # sockets: keep the path short
    link = "[link]\ndelay_ms = 5\nrate_mbit = 200\nqueue_packets = 400\n"
    try:
        with trio_across_lab(root / "w", tiny_llama_f32, link, "v2r", md_orphan_s=5.0) as t:
            yield t
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _cfg(trio: Any) -> Any:
    from router import RouterConfig, VllmEngineConfig

    v = VllmEngineConfig(
        p_url=trio.p.url,
        md_url=trio.md.url,
        rld_url=trio.rld.url,
        model=str(trio.spec.model),
        rld_gets_kv=True,
    )
    return RouterConfig(engine="vllm", vllm=v, vocab_size=1024, recompute=False, line_mbit=200.0)


def _pairs(n: int, seed: int) -> list[tuple[tuple[Any, ...], tuple[Any, ...]]]:
    from engines_adapter import SamplingParams

    rng = random.Random(seed)

    def one() -> tuple[Any, ...]:
        prompt = tuple(rng.randrange(3, 1000) for _ in range(rng.randint(40, 160)))
        greedy = rng.random() < 0.5
        sampling = (
            SamplingParams(max_tokens=12)
            if greedy
            else SamplingParams(seed=rng.randrange(1000), temperature=0.8, top_p=0.95, max_tokens=12)
        )
        return prompt, sampling

    return [(one(), one()) for _ in range(n)]


async def _generate(
    router: Any, prompt: tuple[int, ...], sampling: Any, pipeline: str, label: str
) -> dict[str, Any]:
    t0 = time.monotonic()
    tokens: list[int] = []
    final: dict[str, Any] = {}
    try:
        async with asyncio.timeout(DEADLINE_S + 10.0):  # every await bounded
            async for ev in router.generate(
                list(prompt), sampling, pipeline=pipeline, deadline_s=DEADLINE_S, request_id=label
            ):
                if isinstance(ev, RequestEnd):
                    final = ev.to_dict()
                else:
                    tokens.append(ev.token_id)
    except TimeoutError:
        final = {"outcome": "failed", "reason": "client_timeout"}
    except Exception as exc:  # a refusal at the router (InvalidInput, Overloaded): typed
        final = {"outcome": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    return {"tokens": tuple(tokens), "final": final, "seconds": time.monotonic() - t0}


def _judge(r: dict[str, Any], alone: tuple[int, ...]) -> str:
    final = r["final"]
    if final.get("outcome") == "finished" and r["seconds"] <= DEADLINE_S + 1.0:
        return "exact" if r["tokens"] == alone else "wrong"
    reason = str(final.get("reason") or "")
    if r["seconds"] >= HUNG_S or "deadline" in reason or reason == "client_timeout":
        return "hung"
    return "refused" if reason else "untyped"


def _held(trio: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        st = trio.status()
        held = {side: (st[side]["held_slots"], st[side]["held_bytes"], st[side]["in_flight"]) for side in st}
        if not any(any(v) for v in held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def test_the_same_client_id_at_two_vllm_routers_at_once(trio: Any) -> None:
    import httpx

    from router import Router
    from router.vllm_legs import generate_alone

    pairs = _pairs(PAIRS, seed=2525)
    before = trio.status()

    async def go() -> tuple[
        list[tuple[dict[str, Any], dict[str, Any]]], list[tuple[tuple[int, ...], tuple[int, ...]]], float
    ]:
        one, two = Router(_cfg(trio)), Router(_cfg(trio))
        await one.start()
        await two.start()
        out: list[tuple[dict[str, Any], dict[str, Any]]] = []
        t0 = time.monotonic()
        try:
            for start in range(0, PAIRS, WAVE):
                calls = []
                for i in range(start, min(start + WAVE, PAIRS)):
                    (pa, sa), (pb, sb) = pairs[i]
                    pipeline, label = PIPELINES[i % len(PIPELINES)], f"same-{i}"
                    calls += [
                        _generate(one, pa, sa, pipeline, label),
                        _generate(two, pb, sb, pipeline, label),
                    ]
                got = await asyncio.gather(*calls)
                out += list(zip(got[0::2], got[1::2], strict=True))
        finally:
            took = time.monotonic() - t0
            await one.close()
            await two.close()
        alone = []
        async with httpx.AsyncClient() as http:
            model = str(trio.spec.model)
            for (pa, sa), (pb, sb) in pairs:
                alone.append(
                    (
                        await generate_alone(http, trio.p.url, model, pa, sa),
                        await generate_alone(http, trio.p.url, model, pb, sb),
                    )
                )
        return out, alone, took

    results, alone, took = asyncio.run(go())
    after = trio.status()
    verdicts: dict[str, int] = {}
    bad = []
    for i, ((ra, rb), (xa, xb)) in enumerate(zip(results, alone, strict=True)):
        for r, expected in ((ra, xa), (rb, xb)):
            v = _judge(r, expected)
            verdicts[v] = verdicts.get(v, 0) + 1
            if v not in ("exact", "refused"):
                bad.append((i, v, PIPELINES[i % len(PIPELINES)], r["final"].get("reason"), r["seconds"]))
        fa, fb = ra["final"], rb["final"]
        if fa.get("outcome") == fb.get("outcome") == "finished":  # two keys, one label
            assert fa["request_id"] == fb["request_id"] == f"same-{i}"
            assert fa["request_key"] != fb["request_key"]
    figures = {"pairs": PAIRS, "requests": 2 * PAIRS, "seconds": round(took, 1), **verdicts}
    print("vLLM, two routers, one client id:", json.dumps(figures))
    assert not bad, (figures, bad[:10])
    assert verdicts.get("exact", 0) + verdicts.get("refused", 0) == 2 * PAIRS
    # the keys really named transfers: P shipped and MD and RLD loaded KV under them
    moved = {
        "p_shipped": after["p"]["shipped"] - before["p"]["shipped"],
        "md_loaded": after["md"]["loaded"] - before["md"]["loaded"],
        "rld_loaded": after["rld"]["loaded"] - before["rld"]["loaded"],
    }
    print("transfers:", json.dumps(moved))
    assert moved["p_shipped"] >= PAIRS and moved["md_loaded"] > 0 and moved["rld_loaded"] > 0, moved
    assert _held(trio) == {"p": (0, 0, 0), "rld": (0, 0, 0), "md": (0, 0, 0)}
