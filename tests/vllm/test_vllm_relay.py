"""PDD on real vLLM: P, RelayDecode (RLD) and MainDecode (MD), each a vLLM OpenAI server beside its
sidecar, MD across a netlab WAN (loopback lab), RLD on P's fast path (TCP here, no RDMA device).

- One prefill on P ships to both: RLD gets every whole block over the fast path and streams at once;
  its greedy and seeded tokens equal one vLLM alone, and the KV RLD's vLLM holds equals P's byte for
  byte.
- The token-id handoff in ONE request: MD gets prompt + the k tokens RLD generated with the
  transfer's params (``kv_tokens`` = P's prompt length); MD loads the prompt's whole blocks from the
  transfer, computes the tail and the k tokens in one step, and continues exactly (float32 greedy,
  and seeded temperature 0.8 / top-p 0.95 with ``PositionSeededSampling``).
- Faults (last, they end servers): the WAN cut past the deadline, RLD's vLLM killed, MD's vLLM killed
  mid-transfer: every request ends before its deadline with a reason; nothing is held afterwards
  (held slots and transfers in flight, from the sidecars' status).
The session's shared trio (tests/conftest.py: 400 Mbit/s WAN, MD cache 160 blocks, KV dumped); its last
tests kill RLD's and MD's vLLM, started again for the next module.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import pytest

# `fleet`: the vLLM trio (three servers) and its restarts; `make test-fleet` runs it, CI does not
pytestmark = [pytest.mark.fleet, pytest.mark.vllm, pytest.mark.netlab, pytest.mark.timeout(600)]
N = 12  # tokens per request


@pytest.fixture(scope="module")
def trio(vllm_trio: Any) -> Any:
    return vllm_trio  # the session's shared trio (tests/conftest.py)


def _body(
    trio: Any, prompt: list[int], max_tokens: int, sampling: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    return {
        "model": str(trio.spec.model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        **sampling,
        **extra,
    }


def _kv(transfer: str, deadline_s: float, **more: Any) -> dict[str, Any]:
    return {"kv_transfer_params": {"pddlink": {"transfer": transfer, "deadline_s": deadline_s, **more}}}


async def _stream(http: Any, url: str, body: dict[str, Any], timeout_s: float) -> tuple[list[int], str, int]:
    """The tokens, the finish reason ("" if none came) and vLLM's cached prompt tokens."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    tokens: list[int] = []
    finish, cached = "", -1
    async with http.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            return tokens, f"http {r.status_code}: {(await r.aread())[:200]!r}", cached
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return tokens, f"error: {chunk['error']}", cached
            for c in chunk.get("choices") or []:
                tokens += [int(x) for x in c.get("token_ids") or []]
                finish = c.get("finish_reason") or finish
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
    return tokens, finish, cached


async def _pdd_one(
    http: Any, trio: Any, prompt: list[int], k: int, sampling: dict[str, Any], transfer: str
) -> dict[str, Any]:
    """P prefills once and ships to RLD and MD; RLD streams; MD is handed prompt + RLD's first k."""
    alone, _, _ = await _stream(http, trio.p.url, _body(trio, prompt, N, sampling), 60)
    kv = _kv(transfer, 30.0)
    p_task = asyncio.ensure_future(_stream(http, trio.p.url, _body(trio, prompt, 1, sampling, **kv), 60))
    rld, rld_finish, _ = await _stream(http, trio.rld.url, _body(trio, prompt, N, sampling, **kv), 60)
    p_tokens, _, _ = await p_task
    md_kv = _kv(transfer, 30.0, kv_tokens=len(prompt))
    md, md_finish, cached = await _stream(
        http, trio.md.url, _body(trio, prompt + rld[:k], N - k, sampling, **md_kv), 60
    )
    return {
        "alone": alone,
        "p": p_tokens,
        "rld": rld,
        "rld_finish": rld_finish,
        "md": md,
        "md_finish": md_finish,
        "cached": cached,
        "k": k,
    }


async def _killed(server: Any, stream: Any) -> str:
    """SIGKILL ``server``; how the client's ``stream`` to it ended (its finish reason, or the error)."""
    import httpx

    server.kill()
    try:
        _, finish, _ = await stream
    except httpx.HTTPError as exc:
        finish = f"{type(exc).__name__}: {exc}"
    return str(finish)


def _held(trio: Any) -> list[int]:
    st = trio.status()
    return [st[s][key] for s in ("p", "rld", "md") for key in ("held_slots", "in_flight")]


def _wait_released(trio: Any, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(held := _held(trio)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


def _bytes_per_block(trio: Any) -> int:
    return 2 * 2 * trio.spec.block_size * 2 * 64 * 4  # layers, KV heads, block, K+V, head_dim, f32


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randint(40, 200))] for _ in range(n)]


def test_rld_streams_from_fast_path_kv_and_md_continues_in_one_request(trio: Any) -> None:
    import httpx

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=None) as http:
            out = []
            for i, prompt in enumerate(_prompts(8, seed=13)):
                seeded = i % 2 == 1
                sampling = (
                    {"temperature": 0.8, "top_p": 0.95, "seed": 3000 + i} if seeded else {"temperature": 0}
                )
                out.append(await _pdd_one(http, trio, prompt, 1 + (i * 3) % (N - 1), sampling, f"pdd-{i}"))
            return out

    before = trio.status()
    runs = asyncio.run(run())
    bs = trio.spec.block_size
    prompts = _prompts(8, seed=13)
    for prompt, r in zip(prompts, runs, strict=True):
        assert len(r["alone"]) == N, r
        assert r["rld"] == r["alone"], r  # RLD from the shipped KV = vLLM alone
        assert r["md_finish"] in ("length", "stop"), r
        assert r["rld"][: r["k"]] + r["md"] == r["alone"], (len(prompt), r)
    after = trio.status()
    assert after["rld"]["loaded"] - before["rld"]["loaded"] == len(runs)
    assert after["md"]["loaded"] - before["md"]["loaded"] == len(runs)
    assert after["p"]["legs"]["rld"]["shipped"] - before["p"]["legs"]["rld"]["shipped"] == len(runs)
    # the KV RLD's vLLM holds after the load equals what P's vLLM held, byte for byte
    dump, per_block = trio.spec.kv_dump_dir, _bytes_per_block(trio)
    for i, prompt in enumerate(prompts):
        (p_file,) = dump.glob(f"P-pdd-{i}-*.bin")
        (rld_file,) = dump.glob(f"RLD-pdd-{i}-*.bin")
        assert p_file.name.endswith("-0.bin") and rld_file.name.endswith("-0.bin")
        rld_bytes = rld_file.read_bytes()
        assert len(rld_bytes) == (len(prompt) - 1) // bs * per_block
        assert rld_bytes == p_file.read_bytes()
        # MD loaded the prompt's whole blocks from the transfer (it never saw the prompt before)
        ends = trio.finished()
        assert ends[f"pdd-{i}"]["loaded"] and ends[f"pdd-{i}"]["local_tokens"] == 0, ends[f"pdd-{i}"]
        (md_file,) = dump.glob(f"MD-pdd-{i}-*.bin")
        assert md_file.name.endswith("-0.bin") and md_file.read_bytes() == p_file.read_bytes()
        shipped = trio.shipped(f"pdd-{i}")
        assert shipped["legs"]["rld"]["ok"] and shipped["legs"]["md"]["ok"], shipped
        assert shipped["legs"]["rld"]["wan_bytes"] == len(rld_bytes)
        assert shipped["legs"]["rld"]["transport"] == "tcp"
    assert _wait_released(trio) == [0] * 6


def test_rld_drc_the_next_turn_ships_rld_only_what_it_lacks(trio: Any) -> None:
    """RLD's sidecar keeps a DRC fed by RLD vLLM's own KV events: a conversation's next turn (the
    first turn's prompt + RLD's answer + new tokens) reserves what RLD's vLLM holds, so P ships RLD
    only the blocks from there (where RLD without a DRC got every whole block of every turn), and
    RLD's tokens still equal vLLM alone's."""
    import httpx

    rng = random.Random(31)
    first = [rng.randrange(3, 1024) for _ in range(230)]
    greedy = {"temperature": 0}
    bs = trio.spec.block_size

    async def relayed(http: Any, prompt: list[int], transfer: str) -> tuple[list[int], int]:
        kv = _kv(transfer, 30.0, to=["rld"])
        p = asyncio.ensure_future(_stream(http, trio.p.url, _body(trio, prompt, 1, greedy, **kv), 60))
        rld, finish, cached = await _stream(http, trio.rld.url, _body(trio, prompt, N, greedy, **kv), 60)
        await p
        assert finish == "length", finish
        return rld, cached

    def rld_blocks() -> int:
        return int(trio.status()["rld"]["drc_blocks"])

    async def run() -> tuple[list[int], list[int], list[int], int]:
        async with httpx.AsyncClient(timeout=None) as http:
            before = rld_blocks()
            answer, _ = await relayed(http, first, "turn-0")
            until = time.monotonic() + 10  # RLD vLLM's events reach its sidecar's index
            while rld_blocks() < before + len(first) // bs and time.monotonic() < until:
                await asyncio.sleep(0.1)
            second = first + answer + [rng.randrange(3, 1024) for _ in range(100)]
            alone, _, _ = await _stream(http, trio.p.url, _body(trio, second, N, greedy), 60)
            got, cached = await relayed(http, second, "turn-1")
            return second, alone, got, cached

    second, alone, got, cached = asyncio.run(run())
    assert got == alone
    shipped = trio.shipped("turn-1")
    assert shipped is not None and shipped["legs"]["rld"]["ok"], shipped
    rld_first = shipped["legs"]["rld"]["first_block"]
    assert rld_first >= len(first) // bs, shipped  # at least the first turn's whole prompt blocks
    whole = (len(second) - 1) // bs
    assert shipped["legs"]["rld"]["wan_bytes"] == (whole - rld_first) * _bytes_per_block(trio)
    assert cached >= rld_first * bs  # RLD's vLLM used its own cache for them
    assert _wait_released(trio) == [0] * 6


def test_wan_cut_past_deadline_rld_finishes_and_md_ends_in_time(trio: Any) -> None:
    """The WAN is cut while P ships: RLD (fast path) streams every token; MD's request, opened at
    once as the router's relay leg does (parked until its KV lands), gives the KV up at its transfer
    deadline and prefills itself, ending before the request's deadline; P's md leg fails with the
    reason, the rld leg succeeds; nothing is held afterwards."""
    import httpx

    prompt = [random.Random(5).randrange(3, 1024) for _ in range(300)]
    deadline_s = 8.0  # room for MD's own prefill and decode after it gave the KV up (a shared CPU)

    async def run() -> tuple[list[int], list[int], tuple[list[int], str, int], dict[str, float]]:
        async with httpx.AsyncClient(timeout=None) as http:
            greedy = {"temperature": 0}
            alone, _, _ = await _stream(http, trio.p.url, _body(trio, prompt, N, greedy), 60)
            kv = _kv("cut-1", deadline_s)
            md_kv = _kv("cut-1", 0.4 * deadline_s, kv_tokens=len(prompt))  # the router's wan share
            t0 = time.monotonic()
            md = asyncio.ensure_future(
                _stream(http, trio.md.url, _body(trio, prompt, N, greedy, **md_kv), 60)
            )
            p = asyncio.ensure_future(_stream(http, trio.p.url, _body(trio, prompt, 1, greedy, **kv), 60))
            rld, _, _ = await _stream(http, trio.rld.url, _body(trio, prompt, N, greedy, **kv), 60)
            at = {"rld": time.monotonic() - t0}
            await p
            got = await md
            at["md"] = time.monotonic() - t0
            return alone, rld, got, at

    trio.lab.set_outage(True)
    try:
        alone, rld, (md, md_finish, _), at = asyncio.run(run())
        until = time.monotonic() + 20  # the cut lasts past P's deadline for its md leg
        while (shipped := trio.shipped("cut-1")) is None:
            assert time.monotonic() < until, "P's shipment did not end"
            time.sleep(0.2)
    finally:
        trio.lab.set_outage(False)
    assert rld == alone  # MD unreachable: RLD has the whole KV and finishes
    assert at["md"] < deadline_s, at
    # MD never saw the transfer in time: it prefilled itself (exact) or failed with a reason
    if md_finish in ("length", "stop"):
        assert md == alone
    else:
        assert md_finish, "MD's request ended without a reason"
    recomputed = trio.status()["md"]["recomputed"]
    assert recomputed.get("deadline_exceeded", 0) >= 1, recomputed
    assert shipped["legs"]["rld"]["ok"] is True
    assert shipped["legs"]["md"]["ok"] is False and shipped["legs"]["md"]["error"], shipped
    assert _wait_released(trio) == [0] * 6


def test_rld_vllm_killed_request_ends_and_nothing_held(trio: Any) -> None:
    """RLD's vLLM dies while it streams: its client sees it at once, P's MD leg still lands and MD
    serves the request alone (the P->MD fallback); RLD's landed-but-unloaded KV is swept."""
    import httpx

    prompt = [random.Random(21).randrange(3, 1024) for _ in range(1500)]

    async def run() -> tuple[str, float, list[int], str]:
        async with httpx.AsyncClient(timeout=None) as http:
            greedy = {"temperature": 0}
            kv = _kv("rldkill-1", 10.0)
            t0 = time.monotonic()
            p = asyncio.ensure_future(_stream(http, trio.p.url, _body(trio, prompt, 1, greedy, **kv), 60))
            rld = asyncio.ensure_future(
                _stream(http, trio.rld.url, _body(trio, prompt, 3000, greedy, **kv), 60)
            )
            await asyncio.sleep(0.3)
            rld_finish = await _killed(trio.rld, rld)
            took = time.monotonic() - t0
            await p
            md_kv = _kv("rldkill-1", 10.0, kv_tokens=len(prompt))
            md, md_finish, _ = await _stream(http, trio.md.url, _body(trio, prompt, N, greedy, **md_kv), 60)
            return rld_finish, took, md, md_finish

    rld_finish, took, md, md_finish = asyncio.run(run())
    assert rld_finish not in ("length", "stop", ""), rld_finish  # ended, with a reason
    assert took < 10.0
    assert md_finish in ("length", "stop") and len(md) == N
    assert _wait_released(trio, 20.0) == [0] * 6  # RLD's landed slot: swept after orphan_s


def test_md_vllm_killed_mid_transfer_ends_in_time_and_nothing_held(trio: Any) -> None:
    """Runs last: MD's vLLM is gone afterwards."""
    import httpx

    prompt = [random.Random(9).randrange(3, 1024) for _ in range(2000)]
    deadline_s = 10.0

    async def run() -> tuple[str, float]:
        async with httpx.AsyncClient(timeout=None) as http:
            greedy = {"temperature": 0}
            kv = _kv("mdkill-1", deadline_s, kv_tokens=len(prompt))
            t0 = time.monotonic()
            md = asyncio.ensure_future(_stream(http, trio.md.url, _body(trio, prompt, N, greedy, **kv), 60))
            p = asyncio.ensure_future(_stream(http, trio.p.url, _body(trio, prompt, 1, greedy, **kv), 60))
            while "mdkill-1" not in trio.in_flight():
                if md.done() or time.monotonic() - t0 > 8:
                    break
                await asyncio.sleep(0.01)
            finish = await _killed(trio.md, md)
            took = time.monotonic() - t0
            await p
            return finish, took

    finish, took = asyncio.run(run())
    assert finish not in ("length", "stop", ""), finish
    assert took < deadline_s
    assert _wait_released(trio, 20.0) == [0] * 6
