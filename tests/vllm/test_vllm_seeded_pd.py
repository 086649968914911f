"""Seeded sampling across real vLLM OpenAI servers with the position-keyed draw loaded
(``--logits-processors engines_adapter.vllm.sampling:PositionSeededSampling``, float32):

- P->MD through the connector (P prefills and ships the KV, MD samples every token) gives the
  tokens of one vLLM generating alone, for seeded requests at temperature 0.8, top-p 0.95;
- MD handed prompt + the first k tokens another instance generated continues that sequence exactly;
- the handoff on vLLM (``router.vllm_handoff``): P ships the prompt's KV, MD loads it (prime), then
  extends prompt + k ids with the prompt found in its prefix cache and continues: greedy and seeded
  outputs equal one vLLM alone, and vLLM's own cached-token count shows the prompt was not recomputed.
One pair of servers for the module."""

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

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
FQCN = "engines_adapter.vllm.sampling:PositionSeededSampling"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair() -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    from engines_adapter.vllm.pair import PairSpec, VllmPair
    from engines_adapter.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="pddlink-seeded-"))  # sockets: keep the path short
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype="float32"))
    extra = ("--logits-processors", FQCN, "--enable-prompt-tokens-details")
    p = VllmPair(PairSpec(root / "w", model, dtype="float32", extra_args=extra))
    try:
        p.start()
        yield p
    finally:
        p.close()
        shutil.rmtree(root, ignore_errors=True)


def _driver(pair: Any) -> Any:
    from router.vllm_driver import VllmDriver

    return VllmDriver(pair.p.url, pair.md.url, str(pair.spec.model))


def _prompts(n: int, seed: int = 7) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 1024) for _ in range(rng.randint(20, 120))) for _ in range(n)]


def test_seeded_p_md_and_a_continuation_equal_one_vllm_alone(pair: Any) -> None:
    from router.vllm_driver import DriveRequest

    async def run() -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]:
        driver = _driver(pair)
        out = []
        try:
            for i, prompt in enumerate(_prompts(12)):
                seeded = {"temperature": 0.8, "seed": 1000 + i, "top_p": 0.95}
                req = DriveRequest(prompt, MAX_TOKENS, 60.0, **seeded)
                alone = await driver.generate_alone(pair.p.url, req)
                got = (await driver.run_p_md(req)).tokens
                k = 1 + i % (MAX_TOKENS - 1)
                cont_req = DriveRequest(prompt + alone[:k], MAX_TOKENS - k, 60.0, **seeded)
                continued = await driver.generate_alone(pair.md.url, cont_req)  # MD, no connector
                out.append((alone, got, alone[:k] + continued, k))
        finally:
            await driver.close()
        return out

    runs = asyncio.run(run())
    for alone, via_p_md, handed, k in runs:
        assert len(alone) == MAX_TOKENS
        assert via_p_md == alone
        assert handed == alone, k
    assert len({r[0] for r in runs}) == len(runs)


def test_handoff_on_vllm_prime_then_extend_continues_exactly(pair: Any) -> None:
    import httpx

    from router.vllm_driver import DriveRequest
    from router.vllm_handoff import handoff_on_md

    block = pair.spec.block_size

    async def run() -> list[tuple[Any, ...]]:
        driver = _driver(pair)
        http = httpx.AsyncClient(timeout=None)
        out = []
        try:
            for i, prompt in enumerate(_prompts(8, seed=11)):  # prompts MD has never seen
                seeded = i % 2 == 1
                sampling = (
                    {"temperature": 0.8, "top_p": 0.95, "seed": 2000 + i} if seeded else {"temperature": 0.0}
                )
                req = DriveRequest(prompt, MAX_TOKENS, 60.0, **sampling)
                alone = await driver.generate_alone(pair.p.url, req)
                transfer = f"handoff-{i}"
                kv = {"pddlink": {"transfer": transfer, "deadline_s": 30.0}}
                body = {"model": str(pair.spec.model), "prompt": list(prompt), "max_tokens": 1,
                        "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": kv,
                        **sampling}  # fmt: skip
                shipped = await http.post(pair.p.url + "/v1/completions", json=body)
                assert shipped.status_code == 200, shipped.text
                k = 1 + (i * 3) % (MAX_TOKENS - 1)  # the tokens RelayDecode generated
                result = await handoff_on_md(
                    http, pair.md.url, str(pair.spec.model), prompt, alone[:k], max_tokens=MAX_TOKENS,
                    sampling=sampling, deadline=time.monotonic() + 60.0, transfer=transfer,
                )  # fmt: skip
                out.append((prompt, alone, k, result))
        finally:
            await driver.close()
            await http.aclose()
        return out

    def used() -> tuple[int, int]:
        md = pair.status()["md"]
        return md["loaded"], md["landed"]

    before = used()
    runs = asyncio.run(run())
    for prompt, alone, k, result in runs:
        assert alone[:k] + result.tokens == alone, (len(prompt), k)
        assert result.cached_tokens >= len(prompt) // block * block, (len(prompt), result)
        assert result.extend_tokens >= k
    # a prime ships only the blocks MD's DRC lacks (none when it holds them all), and a landed one is
    # loaded unless MD's vLLM held those blocks by then (its KV events lag a step behind its cache):
    # either way the prompt's KV was on MD (cached_tokens above) and nothing came from partial KV
    loaded, landed = (now - was for now, was in zip(used(), before, strict=True))
    assert 1 <= loaded <= landed <= len(runs)
