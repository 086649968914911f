"""The router in front of real vLLM instances (``engine = "vllm"``), its DRC mirror and its faults:
P, RelayDecode and MD as vLLM servers beside their sidecars (``VllmTrio``, float32,
``PositionSeededSampling``), MD across a netlab WAN (loopback lab), RLD on P's fast path.

- The mirror, from vLLM's event objects: never a longer prefix than it saw (late join, gaps, MD
  dead). The router subscribes to MD vLLM's own KV-cache events; after a request MD served,
  the router's view holds the prompt's whole blocks (and the next request's trace says so); MD's
  cache evicting them (a small MD cache, other prompts) makes the view forget them; the view never
  claims more than MD's vLLM reports cached.
- The WAN cut for longer than the deadline: a relayed request finishes on RLD (exact); a P->MD one
  (no RLD) ends before its deadline: MD gives the KV up at its transfer deadline and prefills
  itself (exact), or it fails with a reason.
- MD's vLLM killed (-9) mid-request: the relayed request finishes on RLD (exact), the P->MD one
  fails with a reason before its deadline; the backend marks MD dead, new requests keep off it
  (singular on RLD) and the mirror is emptied; MD restarted: once /health answers, the router uses
  it again (P->MD finishes, exact).
- RLD's vLLM killed mid-stream (the WAN cut, so MD holds nothing of it yet): MD takes over from the
  tokens RLD streamed (it prefills them itself), exact, before the deadline; or a reason in time.
  The backend marks RLD dead.
After each: nothing held by any sidecar (slots, bytes, transfers in flight, MD's DRC leases).
The session's shared trio (tests/conftest.py); the tests run in order (the last ones kill servers).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace
from typing import Any

import pytest

from router.answer import RequestEnd

pytestmark = [pytest.mark.vllm, pytest.mark.netlab, pytest.mark.timeout(900)]
# a request the router fails at its deadline ends when the deadline fires; its end reaches the caller
# a moment later (measured: 8.012 s for an 8 s deadline on a loaded machine)
END_GRACE_S = 0.5
MD_BLOCKS = 160  # MD's vLLM cache in 32-token blocks (5120 tokens): the mirror test evicts from it


@pytest.fixture(scope="module")
def trio(vllm_trio: Any) -> Any:
    return vllm_trio  # the session's shared trio (tests/conftest.py)


def _cfg(trio: Any, **kw: Any) -> Any:
    from router import RouterConfig, VllmEngineConfig

    v = VllmEngineConfig(
        p_url=trio.p.url,
        md_url=trio.md.url,
        rld_url=trio.rld.url,
        model=str(trio.spec.model),
        rld_gets_kv=True,
        md_kv_events=trio.md_kv_events,
    )
    vk = {k: kw.pop(k) for k in list(kw) if k in VllmEngineConfig.__dataclass_fields__}
    return RouterConfig(
        engine="vllm", vllm=replace(v, **vk), vocab_size=1024, recompute=False, line_mbit=200.0, **kw
    )


def _why(trio: Any, final: dict[str, Any]) -> str:
    """A failed assertion's context: the request's whole trace, the sidecars' status and what the
    vLLM logs said of KV."""
    lines = [json.dumps(final, default=str), json.dumps(trio.status(), default=str)[:4000]]
    for name in ("p", "rld", "md"):
        log = trio.spec.workdir / f"{name}-vllm.log"
        if log.exists():
            text = log.read_text(errors="replace").splitlines()
            said = [ln for ln in text if "pddlink" in ln or "KV" in ln]
            lines += [f"{name}: {ln}" for ln in said[-12:]]
    return "\n".join(lines)


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 1000) for _ in range(n))


async def _one(
    router: Any,
    prompt: tuple[int, ...],
    sampling: Any,
    pipeline: str,
    deadline_s: float,
    tokens: list[int] | None = None,
) -> Any:
    """(tokens, final event, seconds it took); positions checked: no gap, no duplicate. ``tokens``:
    the list the tokens go to as they come (the caller watches the progress)."""
    tokens = [] if tokens is None else tokens
    positions: list[int] = []
    final: dict[str, Any] = {}
    t0 = time.monotonic()
    async for ev in router.generate(list(prompt), sampling, pipeline=pipeline, deadline_s=deadline_s):
        if isinstance(ev, RequestEnd):
            final = ev.to_dict()
        else:
            tokens.append(ev.token_id)
            positions.append(ev.position)
    assert positions == list(range(len(prompt), len(prompt) + len(tokens)))
    return tokens, final, time.monotonic() - t0


async def _alone(trio: Any, prompt: tuple[int, ...], sampling: Any) -> tuple[int, ...]:
    import httpx

    from router.vllm_legs import generate_alone

    async with httpx.AsyncClient() as http:
        return await generate_alone(http, trio.p.url, str(trio.spec.model), prompt, sampling)


async def _md_cached(trio: Any, prompt: tuple[int, ...]) -> int:
    """What MD's vLLM itself reports cached of ``prompt`` (one 1-token request, no transfer)."""
    import httpx

    body = {"model": str(trio.spec.model), "prompt": list(prompt), "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient() as http:
        r = await http.post(trio.md.url + "/v1/completions", json=body, timeout=60)
    details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


async def _until(cond: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.1)
    return True


def _mirror(router: Any) -> Any:
    return router.backend.mirror  # router.vllm_backend.VllmBackend's (router.mirror.VllmMirror)


def _held(trio: Any) -> dict[str, Any]:
    st = trio.status()
    out = {side: (st[side]["held_slots"], st[side]["held_bytes"], st[side]["in_flight"]) for side in st}
    out["md_leases"] = trio.md_side.transfers()["leases"]
    return out


NOTHING = {"p": (0, 0, 0), "rld": (0, 0, 0), "md": (0, 0, 0), "md_leases": 0}


def _released(trio: Any, timeout_s: float = 25.0) -> dict[str, Any]:
    """What the sidecars hold once they let go (a killed vLLM's landed slots: swept at orphan_s)."""
    end = time.monotonic() + timeout_s
    while (held := _held(trio)) != NOTHING and time.monotonic() < end:
        time.sleep(0.3)
    return held


def _stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = 4) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list[bytes | int](hashes),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_mirror_never_answers_longer_than_what_it_saw() -> None:
    """``VllmMirror`` fed vLLM's own event objects (no server): a block stored before the mirror
    joined leaves its children unindexed (a shorter answer), a gap in the publisher's sequence
    (lost batches, a restarted vLLM) and MD found dead empty it; the block size is vLLM's own."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    from vllm.distributed.kv_events import BlockRemoved

    from router.mirror import VllmMirror

    m = VllmMirror()
    prompt = tuple(range(10, 22))  # three 4-token blocks
    assert m.matched_tokens(prompt) == 0  # nothing seen, block size unknown
    m.apply([_stored([1, 2], None, list(prompt[:8]))])
    assert m.block_size == 4 and m.matched_tokens(prompt) == 8
    m.apply([_stored([3], 2, list(prompt[8:12]))])
    assert m.matched_tokens(prompt) == 12
    m.apply([BlockRemoved(block_hashes=[2], medium="GPU")])
    assert m.matched_tokens(prompt) == 4  # block 2 and the one after it are gone
    m.apply([_stored([9], 77, list(prompt[4:8]))])  # parent stored before the mirror joined
    assert m.matched_tokens(prompt) == 4 and m.counts["orphans"] == 1
    m.counts["gaps"] += 1  # what the feed counts when a batch's sequence number skips
    m.apply([])
    assert m.matched_tokens(prompt) == 0 and len(m.index) == 0 and m.resets == 1
    m.apply([_stored([1, 2], None, list(prompt[:8]))])
    m.forget_all()  # the backend found MD dead
    assert m.matched_tokens(prompt) == 0 and m.status()["resets"] == 2


@pytest.mark.fleet  # the vLLM trio: `make test-fleet`
def test_mirror_follows_md_prefix_cache_and_forgets_evicted_blocks(trio: Any) -> None:
    from engines_adapter import SamplingParams
    from router import Router

    bs = trio.spec.block_size
    prompt = _prompt(1, 300)
    whole = len(prompt) // bs * bs

    async def go() -> dict[str, Any]:
        router = Router(_cfg(trio))
        await router.start()
        mirror = _mirror(router)
        try:
            assert await _until(lambda: router.backend.usable("md"), 10)
            before = router.backend.matched_tokens(prompt)
            got, final, _ = await _one(router, prompt, SamplingParams(max_tokens=8), "p_md", 30.0)
            assert final["outcome"] == "finished", final
            assert tuple(got) == await _alone(trio, prompt, SamplingParams(max_tokens=8))
            await _until(lambda: router.backend.matched_tokens(prompt) >= whole, 5)
            after = router.backend.matched_tokens(prompt)
            status = router.status()["drc_mirror"]
            # the next request's decision reads the view (its trace carries what it matched)
            _, again, _ = await _one(router, prompt, SamplingParams(max_tokens=4), "p_md", 30.0)
            truth = await _md_cached(trio, prompt)
            # other prompts fill MD's small cache until the first one's blocks are evicted
            for i in range(8):
                other = _prompt(100 + i, 1500)
                await _md_cached(trio, other)
                if router.backend.matched_tokens(prompt) < whole:
                    break
            await _until(lambda: router.backend.matched_tokens(prompt) < whole, 5)
            evicted = router.backend.matched_tokens(prompt)
            truth_after = await _md_cached(trio, prompt)
            return {
                "before": before,
                "after": after,
                "status": status,
                "again": again["trace"]["mirror_matched_tokens"],
                "truth": truth,
                "evicted": evicted,
                "truth_after": truth_after,
                "removed": mirror.counts["removed"],
            }
        finally:
            await router.close()

    r = asyncio.run(go())
    assert r["before"] == 0, r
    assert r["after"] == whole, r  # the prompt's whole blocks, from MD vLLM's own events
    assert r["status"]["blocks"] >= whole // bs and r["status"]["block_size"] == bs, r
    assert r["status"]["source"].startswith("md's vLLM KV events"), r
    assert r["again"] == whole, r
    assert r["truth"] >= r["after"], r  # never more than MD's vLLM holds
    assert r["removed"] > 0 and r["evicted"] < whole, r  # eviction forgets
    assert r["truth_after"] >= r["evicted"], r
    assert _released(trio) == NOTHING


@pytest.mark.fleet  # the vLLM trio: `make test-fleet`
def test_wan_outage_past_deadline_relay_finishes_on_rld_p_md_fails_in_time(trio: Any) -> None:
    from engines_adapter import SamplingParams
    from router import Router

    deadline_s = 8.0
    greedy = SamplingParams(max_tokens=24)
    relayed, direct = _prompt(2, 700), _prompt(3, 700)

    async def go() -> tuple[Any, Any, tuple[tuple[int, ...], tuple[int, ...]]]:
        relay = Router(_cfg(trio, rld_capacity=8))
        no_rld = Router(_cfg(trio, rld_url=""))
        await relay.start()
        await no_rld.start()
        try:
            trio.lab.set_outage(True)
            try:
                a, b = await asyncio.gather(
                    _one(relay, relayed, greedy, "p_rld_md", deadline_s),
                    _one(no_rld, direct, greedy, "p_md", deadline_s),
                )
            finally:
                trio.lab.set_outage(False)
            return a, b, (await _alone(trio, relayed, greedy), await _alone(trio, direct, greedy))
        finally:
            await relay.close()
            await no_rld.close()

    recomputed0 = trio.status()["md"]["recomputed"].get("deadline_exceeded", 0)
    (got, final, took), (p_md_got, p_md, took_p_md), (alone, alone_direct) = asyncio.run(go())
    assert final["outcome"] == "finished" and tuple(got) == alone, final
    assert set(final["trace"]["tokens"]) == {"rld"}, _why(trio, final)  # MD unreachable: RLD finishes
    assert took < deadline_s
    # P->MD: MD's connector gives the KV up at its transfer deadline (the router's wan_share of the
    # time left) and prefills the prompt itself: exact, before the deadline; or a reason in time
    assert took_p_md < deadline_s + END_GRACE_S, (took_p_md, p_md)
    if p_md["outcome"] == "finished":
        assert tuple(p_md_got) == alone_direct, p_md
        assert trio.status()["md"]["recomputed"].get("deadline_exceeded", 0) > recomputed0
    else:
        assert p_md["reason"], p_md
    assert _released(trio) == NOTHING


@pytest.mark.fleet  # the vLLM trio: `make test-fleet`
def test_md_killed_mid_request_then_avoided_and_used_again_once_restarted(trio: Any) -> None:
    from engines_adapter import SamplingParams
    from router import Router

    deadline_s = 25.0
    # long enough to be mid-stream when MD is killed, short enough for RLD to finish within the
    # deadline on a machine whose other half runs the suite's other tests (1500 did not, once)
    long_greedy = SamplingParams(max_tokens=600)
    seeded = SamplingParams(seed=5, temperature=0.8, top_p=0.95, max_tokens=600)
    relayed, direct, later = _prompt(4, 600), _prompt(5, 600), _prompt(6, 200)
    short = SamplingParams(max_tokens=12)

    async def go() -> dict[str, Any]:
        relay = Router(_cfg(trio, rld_capacity=8))
        no_rld = Router(_cfg(trio, rld_url=""))
        await relay.start()
        await no_rld.start()
        try:
            await _one(relay, _prompt(7, 300), short, "p_md", 30.0)  # the mirror holds something
            assert _mirror(relay).index and await _until(lambda: relay.backend.usable("md"), 10)
            seen_a: list[int] = []
            seen_b: list[int] = []
            a = asyncio.ensure_future(_one(relay, relayed, seeded, "p_rld_md", deadline_s, seen_a))
            b = asyncio.ensure_future(_one(no_rld, direct, long_greedy, "p_md", deadline_s, seen_b))
            # kill MD once both requests stream (the P->MD one from MD)
            await _until(lambda: (len(seen_a) > 20 and len(seen_b) > 20) or a.done() or b.done(), 15)
            assert not a.done() and not b.done(), "a request ended before MD was killed"
            trio.md.kill()
            (got, final, took), (_, failed, took_p_md) = await asyncio.gather(a, b)
            noticed = await _until(lambda: not relay.backend.usable("md"), 5)
            mirror_after_death = len(_mirror(relay).index)
            _, avoided, _ = await _one(relay, later, short, "", 30.0)
            trio.md.start()
            trio.md.wait_ready(300)
            back = await _until(lambda: relay.backend.usable("md"), 10)
            back_got, back_final, _ = await _one(relay, later, short, "p_md", 30.0)
            return {
                "relayed": (got, final, took, await _alone(trio, relayed, seeded)),
                "p_md": (failed, took_p_md),
                "noticed": noticed,
                "mirror_after_death": mirror_after_death,
                "avoided": avoided,
                "back": (back, back_got, back_final, await _alone(trio, later, short)),
            }
        finally:
            await relay.close()
            await no_rld.close()

    r = asyncio.run(go())
    got, final, took, alone = r["relayed"]
    assert final["outcome"] == "finished" and tuple(got) == alone, final
    assert "rld" in final["trace"]["tokens"] and took < deadline_s, final["trace"]
    failed, took_p_md = r["p_md"]
    assert failed["outcome"] == "failed" and failed["reason"], failed
    assert took_p_md < deadline_s + END_GRACE_S
    assert r["noticed"], "the backend did not mark MD's dead vLLM unusable"
    assert r["mirror_after_death"] == 0  # a dead MD's blocks are never claimed
    avoided = r["avoided"]
    assert avoided["outcome"] == "finished", avoided
    assert avoided["trace"]["pipeline"] == "singular" and set(avoided["trace"]["tokens"]) == {"rld"}
    back, back_got, back_final, back_alone = r["back"]
    assert back, "the backend did not take MD back once /health answered"
    assert back_final["outcome"] == "finished" and tuple(back_got) == back_alone, back_final
    assert set(back_final["trace"]["tokens"]) == {"md"}, back_final["trace"]
    assert _released(trio) == NOTHING


@pytest.mark.fleet  # the vLLM trio: `make test-fleet`
def test_rld_killed_mid_stream_request_ends_in_time(trio: Any) -> None:
    """Runs last: RLD's vLLM is gone afterwards."""
    from engines_adapter import SamplingParams
    from router import Router

    deadline_s = 20.0
    sampling = SamplingParams(max_tokens=600)
    prompt = _prompt(8, 400)

    async def go() -> tuple[Any, bool, tuple[int, ...]]:
        router = Router(_cfg(trio, rld_capacity=8))
        await router.start()
        try:
            assert await _until(lambda: router.backend.usable("rld") and router.backend.usable("md"), 10)
            # the WAN is cut while RLD streams, so MD cannot have taken the request over yet
            trio.lab.set_outage(True)
            try:
                run = asyncio.ensure_future(_one(router, prompt, sampling, "p_rld_md", deadline_s))
                await asyncio.sleep(1.0)
                trio.rld.kill()
                out = await run
            finally:
                trio.lab.set_outage(False)
            noticed = await _until(lambda: not router.backend.usable("rld"), 5)
            return out, noticed, await _alone(trio, prompt, sampling)
        finally:
            await router.close()

    (got, final, took), noticed, alone = asyncio.run(go())
    assert took < deadline_s + (END_GRACE_S if final["outcome"] == "failed" else 0.0), final
    if final["outcome"] == "finished":  # MD took over (or had the request already): exact
        assert tuple(got) == alone, final
        assert "md" in final["trace"]["tokens"], final["trace"]
    else:
        assert final["reason"], final
    assert noticed, "the backend did not mark RLD's dead vLLM unusable"
    assert _released(trio) == NOTHING
