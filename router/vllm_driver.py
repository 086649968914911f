"""The router's driver for vLLM engines: one P->MD request through vLLM's own OpenAI API.

``EngineDriver`` is the engine-facing interface a router run needs for P->MD (prefill on P with
the KV leaving for MD, then MD's stream); ``VllmDriver`` implements it over HTTP:

  P:  POST /v1/completions {prompt: token ids, max_tokens: 1, kv_transfer_params: {"pddlink":
      {"transfer": ID, "deadline_s": S}}}   -- vLLM prefills, the connector hands the KV to P's sidecar
  MD: POST /v1/completions {the same prompt, max_tokens, stream: true, the same kv_transfer_params}
      -- MD's connector waits for the transfer (vLLM parks the request), then MD streams

Every call runs under the request's deadline; on timeout or a client that goes away the HTTP
stream is closed, which aborts the request in vLLM (the connector's ``request_finished`` then
releases what the sidecars hold). A failed KV load makes vLLM end the stream with finish reason
``error`` (policy "fail"): reported as a failure, never as tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from pddlink.errors import DeadlineExceeded, PddlinkError, RemoteError


@dataclass(frozen=True, slots=True)
class DriveResult:
    request_id: str
    tokens: tuple[int, ...]
    ttft_s: float
    seconds: float
    finish_reason: str
    p_first_token: int
    cached_tokens: int | None = None  # MD's own prefix-cache hit, when vLLM reports it


@dataclass(frozen=True, slots=True)
class DriveRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    deadline_s: float
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    temperature: float = 0.0


class EngineDriver(Protocol):
    async def run_p_md(self, req: DriveRequest) -> DriveResult: ...

    async def generate_alone(self, url: str, req: DriveRequest) -> tuple[int, ...]: ...


class VllmDriver:
    def __init__(self, p_url: str, md_url: str, model: str, *, wan_share: float = 0.6) -> None:
        self.p_url, self.md_url, self.model, self.wan_share = p_url, md_url, model, wan_share
        self.http = httpx.AsyncClient(timeout=None)

    def _body(self, req: DriveRequest, max_tokens: int, **extra: object) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(req.prompt),
            "max_tokens": max_tokens,
            "temperature": req.temperature,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }

    async def run_p_md(self, req: DriveRequest) -> DriveResult:
        t0 = time.monotonic()
        deadline = t0 + req.deadline_s
        # the transfer gets a share of the deadline, so MD's failure report still arrives in time
        kv = {"pddlink": {"transfer": req.request_id, "deadline_s": self.wan_share * req.deadline_s}}
        p = await self._post(self.p_url, self._body(req, 1, kv_transfer_params=kv), deadline)
        p_first = int(p["choices"][0]["token_ids"][0])
        body = self._body(
            req, req.max_tokens, kv_transfer_params=kv, stream=True, stream_options={"include_usage": True}
        )
        tokens: list[int] = []
        ttft = 0.0
        finish = ""
        cached: int | None = None
        try:
            async with self.http.stream(
                "POST", self.md_url + "/v1/completions", json=body, timeout=_left(deadline)
            ) as resp:
                if resp.status_code != 200:
                    raise RemoteError(f"MD answered {resp.status_code}: {(await resp.aread())[:300]!r}")
                async for line in resp.aiter_lines():
                    if time.monotonic() > deadline:
                        raise DeadlineExceeded(f"request {req.request_id} outlived its deadline")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        new = choice.get("token_ids") or []
                        if new and not tokens:
                            ttft = time.monotonic() - t0
                        tokens += [int(t) for t in new]
                        finish = choice.get("finish_reason") or finish
                    usage = chunk.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        cached = int(details["cached_tokens"])
        except httpx.TimeoutException as exc:
            raise DeadlineExceeded(f"request {req.request_id}: MD's stream outlived the deadline") from exc
        except httpx.HTTPError as exc:
            raise RemoteError(f"request {req.request_id}: MD's stream broke: {exc!r}") from exc
        if finish not in ("length", "stop"):
            raise RemoteError(f"request {req.request_id}: MD ended with finish reason {finish!r}")
        return DriveResult(
            req.request_id, tuple(tokens), ttft, time.monotonic() - t0, finish, p_first, cached
        )

    async def generate_alone(self, url: str, req: DriveRequest) -> tuple[int, ...]:
        """One vLLM generating alone (no connector involved): the exactness reference."""
        out = await self._post(url, self._body(req, req.max_tokens), time.monotonic() + req.deadline_s)
        return tuple(int(t) for t in out["choices"][0]["token_ids"])

    async def _post(self, url: str, body: dict[str, object], deadline: float) -> dict[str, Any]:
        try:
            r = await self.http.post(url + "/v1/completions", json=body, timeout=_left(deadline))
        except httpx.TimeoutException as exc:
            raise DeadlineExceeded(f"{url} did not answer before the deadline") from exc
        except httpx.HTTPError as exc:
            raise RemoteError(f"{url}: {exc!r}") from exc
        if r.status_code != 200:
            raise RemoteError(f"{url} answered {r.status_code}: {r.text[:300]}")
        out: dict[str, Any] = r.json()
        return out

    async def close(self) -> None:
        await self.http.aclose()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("no time left")
    return left


__all__ = ["DriveRequest", "DriveResult", "EngineDriver", "PddlinkError", "VllmDriver"]
