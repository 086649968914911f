"""The router over vLLM pools (issue 26 with ``engine = "vllm"``): one P and two MDs as vLLM servers,
each beside its pddlink sidecar, described by one topology file that the router and P's sidecar both
read (``harness.vllm.pool.VllmPool``; float32, ``PositionSeededSampling`` loaded).

- Round robin: the requests alternate between the two MDs; P's sidecar ships each transfer to the
  MD its request names (P's per-instance counts), every answer equals one vLLM generating alone,
  nothing fails, and the sidecars hold nothing afterwards.
- Prefix-aware: each MD's mirror follows that MD's own KV-cache events. A prompt served on md-b1
  (md-b0 drained for it; undrained, md-b0 gets the next request: the rejoin probe) is in md-b1's
  mirror only; the same prefix with a new suffix goes back to md-b1 (md-b0 idle and first in the
  topology: a tie would go there), its trace says what the mirror matched, and P ships only the
  blocks after it (md-b1's DRC held the rest). Every answer equals vLLM alone.
- kill -9 of md-b1's vLLM while a request streams from it: that request moves to md-b0 (a new leg:
  P prefills the prompt and the tokens so far and ships the KV there) and finishes exact, no token
  lost or repeated; md-b1 is out of placement within seconds, its mirror emptied, every request on
  md-b0 (exact); restarted, md-b1 is back in placement and gets the next request.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.answer import RequestEnd

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BS = 32
LONG = 160  # output tokens of the request that is streaming when its MD dies (tiny model: ~1 s)


@pytest.fixture(scope="module")
def pool(tiny_llama_f32: Path) -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    from harness.vllm import SEEDED_SAMPLING
    from harness.vllm.pool import PoolSpec, VllmPool

    root = Path(tempfile.mkdtemp(prefix="pddlink-vpool-"))  # sockets: keep the path short
    spec = PoolSpec(
        root / "w", tiny_llama_f32, block_size=BS, extra_args=("--logits-processors", SEEDED_SAMPLING)
    )
    pool = VllmPool(spec)
    try:
        yield pool.start()
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)


def _cfg(pool: Any, placement: str) -> Any:
    from router import RouterConfig, VllmEngineConfig

    return RouterConfig(
        engine="vllm",
        topology=pool.topology,
        vllm=VllmEngineConfig(model=str(pool.spec.model)),
        placement=placement,
        recompute=False,  # every request's KV crosses from P: P's sidecar must ship to its MD
        vocab_size=1024,
    )


def _prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, 1000) for _ in range(n))


def _sampling(i: int, max_tokens: int = 12) -> Any:
    from engines_adapter import SamplingParams

    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(seed=300 + i, temperature=0.8, top_p=0.95, max_tokens=max_tokens)


async def _one(router: Any, prompt: tuple[int, ...], sampling: Any) -> tuple[list[int], dict[str, Any]]:
    tokens: list[int] = []
    positions: list[int] = []
    final: dict[str, Any] = {}
    async for ev in router.generate(list(prompt), sampling, pipeline="p_md", deadline_s=60.0):
        if isinstance(ev, RequestEnd):
            final = ev.to_dict()
        else:
            tokens.append(ev.token_id)
            positions.append(ev.position)
    assert positions == list(range(len(prompt), len(prompt) + len(tokens)))  # no gap, no duplicate
    return tokens, final


async def _alone(http: Any, pool: Any, prompt: tuple[int, ...], sampling: Any) -> tuple[int, ...]:
    from router.vllm_legs import generate_alone

    return await generate_alone(http, pool.p.url, str(pool.spec.model), prompt, sampling)


async def _until(cond: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.1)
    return True


def _shipped(pool: Any) -> dict[str, int]:
    return {name: c["shipped"] for name, c in pool.status()["p-a0"]["instances"].items()}


def _held(pool: Any, timeout_s: float = 15.0) -> dict[str, tuple[int, int, int]]:
    deadline = time.monotonic() + timeout_s
    while True:
        st = pool.status()
        held = {name: (s["held_slots"], s["held_bytes"], s["in_flight"]) for name, s in st.items()}
        if not any(any(v) for v in held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


NOTHING = {"p-a0": (0, 0, 0), "md-b0": (0, 0, 0), "md-b1": (0, 0, 0)}


def test_round_robin_spreads_over_both_mds_and_every_answer_equals_vllm_alone(pool: Any) -> None:
    import httpx

    from router import Router

    rng = random.Random(26)
    prompts = [_prompt(rng, rng.randint(40, 200)) for _ in range(6)]
    before = _shipped(pool)

    async def go() -> list[tuple[list[int], dict[str, Any], tuple[int, ...]]]:
        router = Router(_cfg(pool, "round_robin"))
        await router.start()
        out = []
        try:
            assert await _until(lambda: router.backend.usable("md-b0") and router.backend.usable("md-b1"), 10)
            async with httpx.AsyncClient() as http:
                for i, prompt in enumerate(prompts):
                    got, final = await _one(router, prompt, _sampling(i))
                    out.append((got, final, await _alone(http, pool, prompt, _sampling(i))))
        finally:
            await router.close()
        return out

    runs = asyncio.run(go())
    placed = []
    for got, final, alone in runs:
        assert final["outcome"] == "finished", final
        assert final["trace"]["pipeline"] == "p_md", final
        assert tuple(got) == alone, final["trace"]
        placed.append(final["trace"]["placement"]["md"])
    assert placed == ["md-b0", "md-b1"] * 3
    after = _shipped(pool)
    assert {k: after[k] - before.get(k, 0) for k in after} == {"md-b0": 3, "md-b1": 3}
    assert _held(pool) == NOTHING


def test_prefix_aware_sends_a_repeated_prefix_back_to_the_md_whose_mirror_holds_it(pool: Any) -> None:
    import httpx

    from router import Router

    rng = random.Random(27)
    prefix = _prompt(rng, 6 * BS + 8)  # six whole blocks
    first, again = prefix, prefix + _prompt(rng, 40)
    other = _prompt(rng, 3 * BS)

    async def go() -> dict[str, Any]:
        router = Router(_cfg(pool, "prefix_aware"))
        await router.start()
        mirrors = router.backend.mirrors
        r: dict[str, Any] = {"runs": []}
        try:
            assert await _until(lambda: router.backend.usable("md-b0") and router.backend.usable("md-b1"), 10)
            async with httpx.AsyncClient() as http:

                async def run(prompt: tuple[int, ...], i: int) -> dict[str, Any]:
                    got, final = await _one(router, prompt, _sampling(i, 8))
                    r["runs"].append((got, final, await _alone(http, pool, prompt, _sampling(i, 8))))
                    return final

                router.drain("md-b0")  # the operator's drain: the first one must go to md-b1
                r["first"] = await run(first, 0)
                router.drain("md-b0", undo=True)
                r["other"] = await run(other, 2)  # md-b0 back: it gets the next one (rejoin probe)
                r["mirrored"] = await _until(lambda: mirrors["md-b1"].matched_tokens(again) >= 6 * BS, 10)
                r["views"] = {name: m.matched_tokens(again) for name, m in mirrors.items()}
                r["done_before"] = set(pool.transfers("p-a0")["done"])
                r["again"] = await run(again, 1)
                done = pool.transfers("p-a0")["done"]
                r["again_shipped"] = [done[t] for t in done if t not in r["done_before"]]
            r["status"] = router.status()
        finally:
            await router.close()
        return r

    r = asyncio.run(go())
    for got, final, alone in r["runs"]:
        assert final["outcome"] == "finished", final
        assert tuple(got) == alone, final["trace"]
    assert r["first"]["trace"]["placement"]["md"] == "md-b1", r["first"]["trace"]["placement"]
    assert r["mirrored"] and r["views"] == {"md-b0": 0, "md-b1": 6 * BS}, r["views"]
    t = r["again"]["trace"]
    assert t["placement"]["md"] == "md-b1" and t["mirror_matched_tokens"] == 6 * BS, t["placement"]
    # P reserved md-b1's cached prefix: only the blocks after it crossed
    (rec,) = r["again_shipped"]
    assert rec["ok"] and rec["instance"] == "md-b1" and rec["first_block"] == 6, rec
    assert r["other"]["trace"]["placement"]["md"] == "md-b0", r["other"]["trace"]["placement"]
    md1 = r["status"]["topology"]["datacenters"][1]["md"][1]
    assert md1["name"] == "md-b1" and md1["mirror_blocks"] >= 6 and md1["health"]["usable"], md1
    assert r["status"]["drc_mirrors"]["md-b1"]["publisher_connected"] is True
    assert _held(pool) == NOTHING


def test_a_killed_md_leaves_placement_at_once_and_is_placed_on_again_once_restarted(pool: Any) -> None:
    """kill -9 of md-b1's vLLM (its sidecar stays): the router's health watch takes md-b1 out of
    placement within a few seconds and empties its mirror; every request then goes to md-b0 and
    finishes exact. md-b1's vLLM started again (as a supervisor would): back in placement once its
    /health answers, and it gets requests again (the next one first: the rejoin probe). Last in the
    module: it restarts a server."""
    import httpx

    from router import Router

    rng = random.Random(28)
    md1 = pool.servers["md-b1"]

    async def go() -> dict[str, Any]:
        router = Router(_cfg(pool, "round_robin"))
        await router.start()
        b = router.backend
        r: dict[str, Any] = {"runs": [], "placed_down": [], "placed_back": []}
        try:
            assert await _until(lambda: b.usable("md-b0") and b.usable("md-b1"), 10)
            async with httpx.AsyncClient() as http:

                async def run(i: int) -> dict[str, Any]:
                    prompt = _prompt(rng, rng.randint(3 * BS, 6 * BS))
                    got, final = await _one(router, prompt, _sampling(i))
                    r["runs"].append((got, final, await _alone(http, pool, prompt, _sampling(i))))
                    return final

                for i in range(2):  # one on each: md-b1's mirror holds its prompt's blocks
                    await run(i)
                r["mirrored"] = await _until(lambda: len(b.mirrors["md-b1"].index) > 0, 10)
                # a long request streaming on md-b1 when its vLLM dies (kill -9 after its 8th token)
                prompt, sampling = _prompt(rng, 4 * BS), _sampling(31, LONG)
                router.drain("md-b0")  # it is placed on md-b1
                got: list[int] = []
                positions: list[int] = []
                final: dict[str, Any] = {}
                killed: asyncio.Future[None] | None = None
                t0 = 0.0
                async for ev in router.generate(list(prompt), sampling, pipeline="p_md", deadline_s=60.0):
                    if isinstance(ev, RequestEnd):
                        final = ev.to_dict()
                        continue
                    got.append(ev.token_id)
                    positions.append(ev.position)
                    if len(got) == 1:
                        router.drain("md-b0", undo=True)  # the MD it can move to
                    if len(got) == 8:
                        t0 = time.monotonic()
                        # SIGKILL now, from the loop: a thread of the executor started it late once,
                        # after md-b1 had streamed the other 152 tokens (CI, 2026-12-05); it reaps
                        assert md1.proc is not None
                        os.killpg(md1.proc.pid, signal.SIGKILL)
                        killed = asyncio.get_running_loop().run_in_executor(None, md1.kill)
                assert killed is not None, final
                await killed
                r["long"] = final, positions == list(range(len(prompt), len(prompt) + len(got)))
                r["runs"].append((got, final, await _alone(http, pool, prompt, sampling)))
                r["out"] = await _until(lambda: not b.usable("md-b1"), 5)
                r["out_s"] = time.monotonic() - t0
                r["emptied"] = len(b.mirrors["md-b1"].index)
                for i in range(4):
                    r["placed_down"].append((await run(10 + i))["trace"]["placement"]["md"])
                r["status_down"] = router.status()["topology"]["datacenters"][1]["md"][1]
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: (md1.start(), md1.wait_ready(300))
                )
                t1 = time.monotonic()
                r["back"] = await _until(lambda: b.usable("md-b1"), 10)
                r["back_s"] = time.monotonic() - t1
                for i in range(2):
                    r["placed_back"].append((await run(20 + i))["trace"]["placement"]["md"])
        finally:
            await router.close()
        return r

    r = asyncio.run(go())
    for got, final, alone in r["runs"]:
        assert final["outcome"] == "finished", final
        assert tuple(got) == alone, final["trace"]
    assert r["mirrored"] and r["out"] and r["out_s"] < 5.0, r
    final, contiguous = r["long"]  # finished (exact, above) on md-b0, no gap, no duplicate
    t = final["trace"]
    assert contiguous and t["placement"]["moved"] == [{"role": "md", "from": "md-b1", "to": "md-b0"}], final
    assert t["placement"]["md"] == "md-b0" and t["tokens"]["md"] == LONG, final  # MD made every token
    assert t["output_tokens"] == LONG and "md_lost_other_md" in t["fallbacks"], final
    assert r["emptied"] == 0, r  # a restarted MD holds nothing: its mirror claims nothing
    assert r["placed_down"] == ["md-b0"] * 4, r
    st = r["status_down"]
    assert st["in_placement"] is False and st["out_because"] == "unreachable" and st["mirror_blocks"] == 0, st
    assert r["back"] and r["placed_back"][0] == "md-b1", r
    print(
        f"\nmd-b1 out of placement {r['out_s']:.1f} s after kill -9; back {r['back_s']:.1f} s after serving"
    )
    assert _held(pool, 25.0) == NOTHING
