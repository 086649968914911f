"""kill -9 of each vLLM server under a small load, its restart, and its sidecar (a process of its
own, read over its admin socket) holding nothing of the dead engine.

P, RelayDecode and MD as vLLM servers beside ``pddlink sidecar`` processes (``VllmTrio``, float32
greedy, P->MD across a loopback netlab WAN), the router in this process. For each role in turn
(MD, RLD, P): a few requests stream through the router, the role's vLLM is killed (-9), the
requests end (finished or failed with a reason, none past its deadline), the sidecar reports its
engine lost; the same server is started again, and right then (before any new traffic) its
sidecar holds 0 transfers in flight, 0 region slots and bytes, 0 DRC blocks and leases. Requests
after the restart finish exactly as P's vLLM alone answers them, and RLD's/MD's DRC holds blocks
again: rebuilt from the new engine's own KV events.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.answer import RequestEnd

pytestmark = [
    pytest.mark.fleet,
    pytest.mark.vllm,
    pytest.mark.netlab,
    pytest.mark.process,
    pytest.mark.timeout(1500),
]
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def trio() -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    import vllm.distributed.kv_events  # noqa: F401  (before the sidecars' loop imports it)

    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama
    from harness.vllm_trio import trio_across_lab

    root = Path(tempfile.mkdtemp(prefix="pddlink-ver-"))
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype="float32"))
    link = "[link]\ndelay_ms = 5\nrate_mbit = 200\nqueue_packets = 400\n"
    try:
        with trio_across_lab(root / "w", model, link, "ver", md_orphan_s=8.0) as t:
            yield t
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 1000) for _ in range(n))


async def _one(
    router: Any, prompt: tuple[int, ...], max_tokens: int, seen: list[int], pipeline: str = ""
) -> dict[str, Any]:
    from engines_adapter import SamplingParams

    final: dict[str, Any] = {}
    positions: list[int] = []
    t0 = time.monotonic()
    sampling = SamplingParams(max_tokens=max_tokens)
    async for ev in router.generate(list(prompt), sampling, deadline_s=DEADLINE_S, pipeline=pipeline):
        if isinstance(ev, RequestEnd):
            final = ev.to_dict()
        else:
            seen.append(ev.token_id)
            positions.append(ev.position)
    assert positions == list(range(len(prompt), len(prompt) + len(seen)))  # no gap, no duplicate
    return {**final, "tokens": tuple(seen), "took_s": time.monotonic() - t0}


async def _alone(trio: Any, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    import httpx

    from engines_adapter import SamplingParams
    from router.vllm_legs import generate_alone

    async with httpx.AsyncClient() as http:
        return await generate_alone(
            http, trio.p.url, str(trio.spec.model), prompt, SamplingParams(max_tokens=max_tokens)
        )


def _engine_state(trio: Any, role: str) -> str:
    return str(trio.sides()[role].status()["engine"]["state"])


async def _until(cond: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.1)
    return True


@pytest.mark.parametrize("role", ["md", "rld", "p"])
def test_killed_vllm_restarted_its_sidecar_holds_nothing_of_the_dead_engine(trio: Any, role: str) -> None:
    from harness.chaos.vllm_faults import sidecar_held
    from harness.chaos.vllm_run import VllmChaosSpec, router_config
    from router import Router

    spec = VllmChaosSpec(deadline_s=DEADLINE_S)
    base = {"md": 10, "rld": 20, "p": 30}[role]

    async def go() -> dict[str, Any]:
        router = Router(router_config(trio, spec))
        await router.start()
        try:
            assert await _until(lambda: all(router.backend.usable(r) for r in ("p", "rld", "md")), 30)
            # a turn first, so the DRC of RLD and MD holds this engine's blocks
            first = await _one(router, _prompt(base, 400), 8, [], "p_rld_md")
            assert first["outcome"] == "finished", first
            before = {r: sidecar_held(trio, r) for r in ("rld", "md")}
            seen: list[list[int]] = [[] for _ in range(3)]
            load = [
                asyncio.ensure_future(_one(router, _prompt(base + 1 + i, 300 + 50 * i), 400, seen[i]))
                for i in range(3)
            ]
            await _until(lambda: sum(map(len, seen)) > 10 or all(t.done() for t in load), 30)
            trio.servers()[role].kill()
            ended = await asyncio.gather(*load)
            lost = await _until(lambda: _engine_state(trio, role) == "lost", 10)
            await asyncio.to_thread(trio.servers()[role].start)
            await asyncio.to_thread(trio.servers()[role].wait_ready, 300)
            after = sidecar_held(trio, role)  # no request has reached the new engine yet
            status = trio.sides()[role].status()
            assert await _until(lambda: router.backend.usable(role), 15)
            prompts = [_prompt(base + 5, 420), _prompt(base + 6, 200)]
            again = [await _one(router, p, 12, [], "p_rld_md") for p in prompts]  # RLD's DRC too
            alone = [await _alone(trio, p, 12) for p in prompts]
            rebuilt = {r: sidecar_held(trio, r) for r in ("rld", "md")}
            return {
                "before": before,
                "ended": ended,
                "lost": lost,
                "after": after,
                "status": status,
                "again": again,
                "alone": alone,
                "rebuilt": rebuilt,
            }
        finally:
            await router.close()

    r = asyncio.run(go())
    if role != "p":
        assert r["before"][role]["drc_blocks"] > 0, r["before"]  # the dead engine's blocks were there
    for e in r["ended"]:  # each request ended in time, finished or failed with a reason
        assert e["took_s"] < DEADLINE_S + 1 and (e["outcome"] == "finished" or e["reason"]), e
    assert r["lost"], f"{role}'s sidecar did not notice its vLLM's death: {r['status']}"
    after = r["after"]
    assert after["in_flight"] == 0 and after["held_slots"] == 0 and after["held_bytes"] == 0, after
    if role != "p":
        assert after["drc_blocks"] == 0 and after["leases"] == 0, after
    assert r["status"]["engine"]["losses"] >= 1, r["status"]
    for got, alone in zip(r["again"], r["alone"], strict=True):
        assert got["outcome"] == "finished" and got["tokens"] == alone, got
    if role != "p":  # the DRC follows the new engine's events
        assert r["rebuilt"][role]["drc_blocks"] > 0, r["rebuilt"]
