"""P->MD on real vLLM across a netlab WAN (loopback relay), with a small MD cache that evicts:
MD's DRC follows vLLM's prefix cache through its KV events; a client that disconnects, a WAN cut
past the deadline and a killed MD end every request in time with a reason and leave nothing held
(read from the sidecars' status). The session's shared pair of servers and its lab."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.netlab, pytest.mark.timeout(600)]
MD_BLOCKS = 160  # the shared pair's MD cache (tests/conftest.py): 1000-token prompts evict each other


@pytest.fixture(scope="module")
def lab_pair(vllm_pair):
    """The session's shared pair (tests/conftest.py): MD's cache of ``MD_BLOCKS`` blocks, P->MD
    across its netlab WAN; the last test here leaves MD's vLLM dead (a later user gets a new pair)."""
    assert vllm_pair.spec.md_num_blocks == MD_BLOCKS
    return vllm_pair.lab, vllm_pair


def _driver(pair):
    from router.vllm_driver import VllmDriver

    return VllmDriver(pair.p.url, pair.md.url, str(pair.spec.model))


def _held(pair) -> list[int]:
    st = pair.status()
    return [st[s][k] for s in ("p", "md") for k in ("held_slots", "in_flight")]


def _wait_released(pair, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(held := _held(pair)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


def test_small_md_cache_evicts_and_drc_follows_vllm(lab_pair) -> None:
    from router.vllm_driver import DriveRequest

    _lab, pair = lab_pair
    rng = random.Random(7)
    base = [rng.randrange(3, 1024) for _ in range(1000)]
    others = [[rng.randrange(3, 1024) for _ in range(1000)] for _ in range(6)]  # 192 blocks > 160
    prompts = [base, *others, [*base, *(rng.randrange(3, 1024) for _ in range(50))]]

    async def run() -> list[tuple[str, bool]]:
        d = _driver(pair)
        out = []
        try:
            for p in prompts:
                req = DriveRequest(tuple(p), 4, 60.0)
                got = await d.run_p_md(req)
                out.append((req.request_id, got.tokens == await d.generate_alone(pair.p.url, req)))
        finally:
            await d.close()
        return out

    results = asyncio.run(run())
    assert all(ok for _, ok in results)
    st = pair.status()["md"]
    assert st["kv_events"]["removed"] > 0 and st["kv_events"]["error"] == ""
    assert st["drc_blocks"] <= MD_BLOCKS
    shipped = pair.shipped_all()
    ends = pair.finished()
    for rid, _ in results:  # what MD's DRC reserved is what MD's vLLM itself held
        assert shipped[rid]["first_block"] * 32 == ends[rid]["local_tokens"], (shipped[rid], ends[rid])
    assert _wait_released(pair) == [0, 0, 0, 0]


def test_client_disconnect_mid_stream_releases_everything(lab_pair) -> None:
    _lab, pair = lab_pair
    prompt = [random.Random(3).randrange(3, 1024) for _ in range(200)]
    kv = {"pddlink": {"transfer": "disconnect-1", "deadline_s": 30}}
    body = {
        "model": str(pair.spec.model),
        "prompt": prompt,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": kv,
    }
    with httpx.Client(timeout=30) as c:
        assert c.post(pair.p.url + "/v1/completions", json={**body, "max_tokens": 1}).status_code == 200
        with c.stream(
            "POST", pair.md.url + "/v1/completions", json={**body, "max_tokens": 3000, "stream": True}
        ) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break  # the client goes away mid-stream
    assert _wait_released(pair) == [0, 0, 0, 0]
    with httpx.Client(timeout=30) as c:  # MD still serves
        assert c.get(pair.md.url + "/health").status_code == 200


def test_wan_cut_past_deadline_ends_in_time_with_a_reason(lab_pair) -> None:
    from router.vllm_driver import DriveRequest

    lab, pair = lab_pair
    prompt = tuple(random.Random(5).randrange(3, 1024) for _ in range(300))
    req = DriveRequest(prompt, 4, 8.0)

    async def run():
        d = _driver(pair)
        try:
            t0 = time.monotonic()
            got = await d.run_p_md(req)
            took = time.monotonic() - t0
            alone = await d.generate_alone(pair.p.url, req)
            return got, took, alone
        finally:
            await d.close()

    lab.set_outage(True)
    try:
        got, took, alone = asyncio.run(run())
    finally:
        lab.set_outage(False)
    assert took < req.deadline_s
    assert got.tokens == alone  # MD prefilled itself: never tokens from KV that did not arrive
    md = pair.status()["md"]
    assert md["recomputed"].get("deadline_exceeded", 0) >= 1, md
    deadline = time.monotonic() + 15
    while req.request_id not in pair.shipped_all():
        assert time.monotonic() < deadline, "P's shipment did not end"
        time.sleep(0.2)
    assert pair.shipped_all()[req.request_id]["ok"] is False
    assert _wait_released(pair) == [0, 0, 0, 0]


def test_md_vllm_killed_mid_transfer(lab_pair) -> None:
    """Runs last: MD's vLLM is gone afterwards."""
    from pddlink.errors import PddlinkError
    from router.vllm_driver import DriveRequest

    _lab, pair = lab_pair
    prompt = tuple(random.Random(9).randrange(3, 1024) for _ in range(2000))
    req = DriveRequest(prompt, 64, 10.0)

    async def run() -> float:
        d = _driver(pair)
        t0 = time.monotonic()
        task = asyncio.ensure_future(d.run_p_md(req))
        try:
            while req.request_id not in pair.in_flight():
                if task.done() or time.monotonic() - t0 > 8:
                    break
                await asyncio.sleep(0.01)
            pair.md.kill()
            with pytest.raises(PddlinkError):
                await task
            return time.monotonic() - t0
        finally:
            await d.close()

    took = asyncio.run(run())
    assert took < req.deadline_s
    assert _wait_released(pair, 20.0) == [0, 0, 0, 0]
