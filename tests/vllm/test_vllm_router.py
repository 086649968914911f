"""The router in front of real vLLM servers (``RouterConfig(engine="vllm")``, ``router.vllm_legs``):
the same ``Router`` and lifecycle machine as for the reference engine, P and MD as vLLM OpenAI
servers beside their pddlink sidecars (``VllmPair``, float32, ``PositionSeededSampling`` loaded).

- P->MD: P prefills and ships, MD loads the transfer and streams: greedy and seeded outputs equal
  one vLLM generating alone, and the sidecars hold nothing afterwards;
- singular: RLD (here P's own server, beside P) streams the whole answer: equal alone;
- relay (P->RLD->MD, RLD = P's server): RLD streams at once, MD loads the prompt's KV (prime) and
  takes over by token ids (extend); every request hands over, one-shot (a loaded RLD) or catch-up
  (a light one), in one merged stream equal to vLLM alone, with tokens from both;
- MD unreachable (a dead URL): the relay falls back to RLD finishing, P->MD to a new leg on RLD
  (the lifecycle machine's table); with no RLD either, P->MD fails with a reason before its deadline.
The session's shared pair of servers (``vllm_pair``, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from router.answer import RequestEnd

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def pair(vllm_pair: Any) -> Any:
    return vllm_pair  # the session's shared pair (tests/conftest.py)


def _cfg(pair: Any, **kw: Any) -> Any:
    from router import RouterConfig, VllmEngineConfig

    v = VllmEngineConfig(p_url=pair.p.url, md_url=pair.md.url, rld_url=pair.p.url, model=str(pair.spec.model))
    vk = {k: kw.pop(k) for k in list(kw) if k in VllmEngineConfig.__dataclass_fields__}
    return RouterConfig(engine="vllm", vllm=replace(v, **vk), vocab_size=1024, **kw)


def _prompts(n: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 1000) for _ in range(rng.randint(40, 200))) for _ in range(n)]


async def _one(
    router: Any, prompt: tuple[int, ...], sampling: Any, pipeline: str
) -> tuple[list[int], dict[str, Any]]:
    tokens: list[int] = []
    positions: list[int] = []
    final: dict[str, Any] = {}
    async for ev in router.generate(list(prompt), sampling, pipeline=pipeline, deadline_s=60.0):
        if isinstance(ev, RequestEnd):
            final = ev.to_dict()
        else:
            tokens.append(ev.token_id)
            positions.append(ev.position)
    assert positions == list(range(len(prompt), len(prompt) + len(tokens)))  # no gap, no duplicate
    return tokens, final


def _run(
    pair: Any,
    cfg: Any,
    jobs: list[tuple[tuple[int, ...], Any, str]],
    before_each: Callable[[], None] = lambda: None,
) -> list[tuple[list[int], dict[str, Any], tuple[int, ...]]]:
    import httpx

    from router import Router
    from router.vllm_legs import generate_alone

    async def go() -> list[tuple[list[int], dict[str, Any], tuple[int, ...]]]:
        router = Router(cfg)
        await router.start()
        out = []
        try:
            async with httpx.AsyncClient() as http:
                for prompt, sampling, pipeline in jobs:
                    before_each()
                    got, final = await _one(router, prompt, sampling, pipeline)
                    alone = await generate_alone(http, pair.p.url, str(pair.spec.model), prompt, sampling)
                    out.append((got, final, alone))
        finally:
            await router.close()
        return out

    return asyncio.run(go())


def _held(pair: Any, timeout_s: float = 15.0) -> dict[str, Any]:
    """What the sidecars hold, once it is nothing or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = pair.status()
        held = {side: (st[side]["held_slots"], st[side]["held_bytes"], st[side]["in_flight"]) for side in st}
        if not any(any(v) for v in held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def test_p_md_and_singular_through_the_router_equal_vllm_alone(pair: Any) -> None:
    from engines_adapter import SamplingParams

    jobs = []
    for i, prompt in enumerate(_prompts(8, 11)):
        sampling = (
            SamplingParams(max_tokens=12)
            if i % 2 == 0
            else SamplingParams(seed=100 + i, temperature=0.8, top_p=0.95, max_tokens=12)
        )
        jobs.append((prompt, sampling, "p_md" if i < 6 else "singular"))
    runs = _run(pair, _cfg(pair), jobs)
    for (got, final, alone), (_, _, pipeline) in zip(runs, jobs, strict=True):
        assert final["outcome"] == "finished", final
        assert final["trace"]["pipeline"] == pipeline
        assert tuple(got) == alone
    assert _held(pair) == {"p": (0, 0, 0), "md": (0, 0, 0)}


# The relay test's set-up, so that the handoff of the expected mode must happen. Each request starts
# with the pair's WAN cut from P to MD for OUTAGE_S: MD can hold the prompt's KV only after RLD
# streamed its first tokens (a handoff with nothing to hand over would be P->MD in disguise). RLD
# (P's server) is reached through a lab of its own whose replies are slow (~6 KB/s: about 20
# tokens a second) while MD is reached directly: MD is always faster than RLD, so a catch-up ends
# with MD at RLD's position, long before either could finish the request (RELAY_TOKENS).
RLD_LINK = "[link]\ndelay_ms = 0\n[b_to_a]\nrate_mbit = 0.05\n"
OUTAGE_S = 1.0
# MD still has hundreds of tokens to stream when it reaches RLD: the run cannot end first
RELAY_TOKENS = 320


@pytest.fixture(scope="module")
def slow_rld_url(pair: Any) -> Iterator[str]:
    from netlab import Lab
    from netlab.profile import parse_profile

    lab = Lab.up(
        parse_profile(RLD_LINK, name="slow-rld"), name=f"vsrld{os.getpid() % 100000}", mode="loopback"
    )
    try:
        yield "http://{}:{}".format(*lab.endpoint("dc-b", pair.p.spec.port))
    finally:
        lab.down()


@pytest.mark.parametrize(
    ("capacity", "mode"),
    [(1, "one_shot"), pytest.param(8, "catch_up", marks=pytest.mark.fleet)],  # catch-up: `make test-fleet`
)
def test_relay_hands_off_by_token_ids_and_merges_exactly(
    pair: Any, slow_rld_url: str, capacity: int, mode: str
) -> None:
    from engines_adapter import SamplingParams

    jobs = [
        (
            p,
            SamplingParams(max_tokens=RELAY_TOKENS)
            if i % 2 == 0
            else SamplingParams(seed=7 + i, temperature=0.8, top_p=0.95, max_tokens=RELAY_TOKENS),
            "p_rld_md",
        )
        for i, p in enumerate(_prompts(4, 20 + capacity))
    ]
    cfg = _cfg(pair, rld_capacity=capacity, rld_url=slow_rld_url)
    try:
        runs = _run(pair, cfg, jobs, lambda: pair.lab.outage(OUTAGE_S, direction="a_to_b"))
    finally:
        pair.lab.set_outage(False)
    for got, final, alone in runs:
        t = final["trace"]
        assert final["outcome"] == "finished", final
        assert tuple(got) == alone, t
        # every request hands over in the mode RLD's load picks, with tokens from both
        assert t.get("handoff_mode") == mode, t
        assert t.get("handoff_outcome", "").startswith("handed_off"), t
        assert set(t["tokens"]) == {"rld", "md"}, t
    assert _held(pair) == {"p": (0, 0, 0), "md": (0, 0, 0)}


def test_md_unreachable_relay_falls_back_to_rld_and_p_md_fails_in_time(pair: Any) -> None:
    from engines_adapter import SamplingParams

    prompt = _prompts(1, 99)[0]
    cfg = _cfg(pair, md_url="http://127.0.0.1:9", rld_capacity=8)
    runs = _run(pair, cfg, [(prompt, SamplingParams(max_tokens=24), "p_rld_md")])
    got, final, alone = runs[0]
    assert final["outcome"] == "finished" and tuple(got) == alone, final
    assert set(final["trace"]["tokens"]) == {"rld"}
    got, final, alone = _run(pair, cfg, [(prompt, SamplingParams(max_tokens=24), "p_md")])[0]
    assert final["outcome"] == "finished" and tuple(got) == alone, final
    assert final["trace"]["fallbacks"] and set(final["trace"]["tokens"]) == {"rld"}, final

    from router import Router

    async def p_md() -> tuple[float, dict[str, Any]]:
        router = Router(_cfg(pair, md_url="http://127.0.0.1:9", rld_url=""))
        await router.start()
        t0 = time.monotonic()
        try:
            _, final = await _one_deadline(router, prompt)
        finally:
            await router.close()
        return time.monotonic() - t0, final

    took, final = asyncio.run(p_md())
    assert final["outcome"] == "failed" and final["reason"], final
    assert took < 5.0


async def _one_deadline(router: Any, prompt: tuple[int, ...]) -> tuple[list[int], dict[str, Any]]:
    from engines_adapter import SamplingParams

    final: dict[str, Any] = {}
    async for ev in router.generate(
        list(prompt), SamplingParams(max_tokens=8), pipeline="p_md", deadline_s=4.0
    ):
        if isinstance(ev, RequestEnd):
            final = ev.to_dict()
    return [], final
