"""The token-id handoff on a vLLM MainDecode, through vLLM's OpenAI API only.

RelayDecode has generated ``given`` (k token ids) after the prompt; MainDecode is to continue from
position ``len(prompt) + k``. Two requests to MD's server::

    prime   {prompt, max_tokens: 1, kv_transfer_params: the prompt's transfer}
            -> MD's connector loads the KV that P shipped (vLLM parks the request until it is in);
               the loaded full blocks stay in MD's prefix cache. Its one token is dropped.
    extend  {prompt + given, max_tokens: rest, no transfer params, stream}
            -> vLLM finds the prompt's blocks in its prefix cache and computes the partial last
               block plus the k given tokens in one step (the extend), then decodes the rest.

Without ``transfer`` (MD already holds the prompt, e.g. from its DRC) only the extend runs. With
``PositionSeededSampling`` loaded on MD, seeded requests continue RelayDecode's random sequence
exactly (``engines_adapter.vllm.sampling``). ``cached_tokens`` is vLLM's own count of prompt tokens
the extend found cached, so a caller sees whether the KV really came from the transfer (else MD
recomputed the prompt: still exact, only slower). Every call runs under the caller's deadline.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pddlink.errors import DeadlineExceeded, InvalidInput, RemoteError


@dataclass(frozen=True, slots=True)
class HandoffResult:
    tokens: tuple[int, ...]  # MD's tokens, from position len(prompt) + len(given) on
    cached_tokens: int  # of prompt + given, found in MD's prefix cache by the extend
    extend_tokens: int  # computed by the extend's forward pass (the rest of prompt + given)
    finish_reason: str
    seconds: float


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the handoff outlived its deadline")
    return left


async def handoff_on_md(
    http: httpx.AsyncClient,
    md_url: str,
    model: str,
    prompt: tuple[int, ...],
    given: tuple[int, ...],
    *,
    max_tokens: int,
    sampling: dict[str, Any],
    deadline: float,
    transfer: str | None = None,
    transfer_deadline_s: float = 30.0,
) -> HandoffResult:
    """MD continues after ``prompt + given``; ``max_tokens`` counts the request's whole output."""
    if not prompt or max_tokens <= len(given):
        raise InvalidInput(f"nothing left to generate: {len(given)} given of max_tokens {max_tokens}")
    t0 = time.monotonic()
    common = {"model": model, "ignore_eos": True, "return_token_ids": True, **sampling}
    if transfer is not None:
        kv = {"pddlink": {"transfer": transfer, "deadline_s": transfer_deadline_s}}
        body = {**common, "prompt": list(prompt), "max_tokens": 1, "kv_transfer_params": kv}
        r = await http.post(md_url + "/v1/completions", json=body, timeout=_left(deadline))
        if r.status_code != 200:
            raise RemoteError(f"MD refused the prime request: {r.status_code} {r.text[:300]}")
        finish = r.json()["choices"][0].get("finish_reason")
        if finish not in ("length", "stop"):
            raise RemoteError(f"MD could not load the prompt's KV (finish reason {finish!r})")
    body = {
        **common,
        "prompt": list(prompt + given),
        "max_tokens": max_tokens - len(given),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens: list[int] = []
    cached = 0
    finish = ""
    async with http.stream("POST", md_url + "/v1/completions", json=body, timeout=_left(deadline)) as resp:
        if resp.status_code != 200:
            raise RemoteError(f"MD refused the extend: {resp.status_code} {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            _left(deadline)
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                tokens += [int(t) for t in choice.get("token_ids") or []]
                finish = choice.get("finish_reason") or finish
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
    if finish not in ("length", "stop"):
        raise RemoteError(f"MD ended the handoff with finish reason {finish!r}")
    total = len(prompt) + len(given)
    return HandoffResult(tuple(tokens), cached, total - cached, finish, time.monotonic() - t0)
