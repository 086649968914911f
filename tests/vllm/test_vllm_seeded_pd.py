"""Seeded sampling across real vLLM OpenAI servers with the position-keyed draw loaded
(``--logits-processors engines_adapter.vllm.sampling:PositionSeededSampling``, float32):

- P->MD through the connector (P prefills and ships the KV, MD samples every token) gives the
  tokens of one vLLM generating alone, for seeded requests at temperature 0.8, top-p 0.95;
- MD handed prompt + the first k tokens another instance generated continues that sequence exactly;
- the relay's handoff on vLLM, in one request (``kv_tokens``, as ``tests/vllm/test_vllm_relay.py``
  runs it on P, RLD and MD): P ships the prompt's KV once; MD is handed prompt + the k ids RelayDecode
  generated (here P's server, generating alone) with the transfer's params, loads the prompt's whole
  blocks from the transfer, computes the tail and the k ids in one step and continues: greedy and
  seeded outputs equal one vLLM alone, and MD's sidecar records the load (nothing of the prompt was
  in MD's own cache).
The session's shared pair of servers (``vllm_pair``, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(vllm_pair: Any) -> Any:
    return vllm_pair


def _driver(pair: Any) -> Any:
    from router.vllm_driver import VllmDriver

    return VllmDriver(pair.p.url, pair.md.url, str(pair.spec.model))


def _prompts(n: int, seed: int = 7, shortest: int = 20) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 1024) for _ in range(rng.randint(shortest, 120))) for _ in range(n)]


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


def test_handoff_in_one_request_continues_exactly_from_the_shipped_kv(pair: Any) -> None:
    import httpx

    from router.vllm_driver import DriveRequest

    model = str(pair.spec.model)

    async def complete(http: Any, url: str, body: dict[str, Any]) -> list[int]:
        body = {"model": model, "return_token_ids": True, "ignore_eos": True, **body}
        r = await http.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("length", "stop"), choice
        return [int(t) for t in choice["token_ids"]]

    async def run() -> list[tuple[Any, ...]]:
        driver = _driver(pair)
        http = httpx.AsyncClient(timeout=60.0)
        out = []
        try:
            # at least one whole block below each prompt's last token travels; MD never saw them
            for i, prompt in enumerate(_prompts(8, seed=11, shortest=40)):
                seeded = i % 2 == 1
                sampling = (
                    {"temperature": 0.8, "top_p": 0.95, "seed": 2000 + i} if seeded else {"temperature": 0.0}
                )
                alone = await driver.generate_alone(
                    pair.p.url, DriveRequest(prompt, MAX_TOKENS, 60.0, **sampling)
                )
                transfer = f"seeded-handoff-{i}"
                kv = {"pddlink": {"transfer": transfer, "deadline_s": 30.0}}
                p_body = {"prompt": list(prompt), "max_tokens": 1, "kv_transfer_params": kv, **sampling}
                await complete(http, pair.p.url, p_body)  # P prefills once and ships the prompt's KV
                k = 1 + (i * 3) % (MAX_TOKENS - 1)  # the tokens RelayDecode generated
                md_kv = {"pddlink": {**kv["pddlink"], "kv_tokens": len(prompt)}}
                md_body = {"prompt": list(prompt + alone[:k]), "max_tokens": MAX_TOKENS - k,
                           "kv_transfer_params": md_kv, **sampling}  # fmt: skip
                out.append((transfer, alone, k, await complete(http, pair.md.url, md_body)))
        finally:
            await driver.close()
            await http.aclose()
        return out

    before = pair.status()["md"]["loaded"]
    runs = asyncio.run(run())
    ends = pair.finished()
    for transfer, alone, k, md in runs:
        assert len(alone) == MAX_TOKENS
        assert list(alone[:k]) + md == list(alone), (transfer, k)
        # MD loaded the prompt's whole blocks from the transfer; its own cache held none of them
        assert ends[transfer]["loaded"] and ends[transfer]["local_tokens"] == 0, ends[transfer]
    assert pair.status()["md"]["loaded"] - before == len(runs)
