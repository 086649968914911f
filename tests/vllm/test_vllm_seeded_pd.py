"""Seeded sampling across real vLLM OpenAI servers with the position-keyed draw loaded
(``--logits-processors engines_adapter.vllm.sampling:PositionSeededSampling``, float32):

- P->MD through the connector (P prefills and ships the KV, MD samples every token) gives the
  tokens of one vLLM generating alone, for seeded requests at temperature 0.8, top-p 0.95;
- MD handed prompt + the first k tokens another instance generated continues that sequence exactly
  (the token-id handoff's sampling half; the KV half needs the connector to load only the prompt).
One pair of servers for the module."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
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
    p = VllmPair(PairSpec(root / "w", model, dtype="float32", extra_args=("--logits-processors", FQCN)))
    try:
        p.start()
        yield p
    finally:
        p.close()
        shutil.rmtree(root, ignore_errors=True)


def _driver(pair: Any) -> Any:
    from sidecar.vllm_driver import VllmDriver

    class SeededDriver(VllmDriver):  # the same HTTP calls, with seed and top_p in the body
        seed = 0

        def _body(self, req: Any, max_tokens: int, **extra: object) -> dict[str, object]:
            return {**super()._body(req, max_tokens, **extra), "seed": self.seed, "top_p": 0.95}

    return SeededDriver(pair.p.url, pair.md.url, str(pair.spec.model))


def _prompts(n: int) -> list[tuple[int, ...]]:
    rng = random.Random(7)
    return [tuple(rng.randrange(3, 1024) for _ in range(rng.randint(20, 120))) for _ in range(n)]


def test_seeded_p_md_and_a_continuation_equal_one_vllm_alone(pair: Any) -> None:
    from sidecar.vllm_driver import DriveRequest

    async def run() -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]:
        driver = _driver(pair)
        out = []
        try:
            for i, prompt in enumerate(_prompts(12)):
                driver.seed = 1000 + i
                req = DriveRequest(prompt, MAX_TOKENS, 60.0, temperature=0.8)
                alone = await driver.generate_alone(pair.p.url, req)
                got = (await driver.run_p_md(req)).tokens
                k = 1 + i % (MAX_TOKENS - 1)
                cont_req = DriveRequest(prompt + alone[:k], MAX_TOKENS - k, 60.0, temperature=0.8)
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
