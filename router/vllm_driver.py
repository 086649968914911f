"""A small client for one P->MD request on vLLM, for the connector's tests and the bench: it runs the
request through the router itself (``Router(RouterConfig(engine="vllm"))``, pipeline forced to
``p_md``), so there is one way a request crosses from P to MD -- ``router.vllm_legs``.

``VllmDriver(p_url, md_url, model)``: ``run_p_md(DriveRequest)`` returns the tokens and timings or
raises ``RemoteError`` with the run's reason (never tokens from KV that did not fully arrive: the
legs turn a failed load into a failed stream); ``generate_alone(url, req)`` is the exactness
reference (``router.vllm_legs.generate_alone``); ``close()``. A ``DriveRequest``'s ``request_id`` (a
uuid4 unless given) is also its key at the sidecars (``Router.generate(request_key=...)``): the
connector's tests find P's and MD's records and KV dumps by it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import httpx

from engines_adapter.base import SamplingParams
from pddlink.errors import PddlinkError, RemoteError
from router import Router
from router.answer import RequestEnd
from router.config import RouterConfig, VllmEngineConfig
from router.vllm_legs import generate_alone


@dataclass(frozen=True, slots=True)
class DriveResult:
    request_id: str
    tokens: tuple[int, ...]
    ttft_s: float
    seconds: float
    finish_reason: str


@dataclass(frozen=True, slots=True)
class DriveRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    deadline_s: float
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.seed, self.temperature, 0, self.top_p, self.max_tokens)


class VllmDriver:
    def __init__(self, p_url: str, md_url: str, model: str, *, wan_share: float = 0.6) -> None:
        v = VllmEngineConfig(p_url=p_url, md_url=md_url, model=model, wan_share=wan_share)
        self.cfg = RouterConfig(  # the servers' own limits apply (max model length, vocabulary)
            engine="vllm", vllm=v, relay_enabled=False, vocab_size=1 << 20, max_prompt_tokens=1 << 20
        )
        self.model = model
        self.http = httpx.AsyncClient(timeout=None)
        self._router: Router | None = None

    async def _started(self) -> Router:
        if self._router is None:
            self._router = Router(self.cfg)
            await self._router.start()
        return self._router

    async def run_p_md(self, req: DriveRequest) -> DriveResult:
        router = await self._started()
        t0 = time.monotonic()
        tokens: list[int] = []
        final: RequestEnd | None = None
        gen = router.generate(
            list(req.prompt),
            req.sampling,
            deadline_s=req.deadline_s,
            pipeline="p_md",
            request_id=req.request_id,
            request_key=req.request_id,  # unique (uuid4): the sidecars' records are found by it
        )
        async for ev in gen:
            if isinstance(ev, RequestEnd):
                final = ev
            else:
                tokens.append(ev.token_id)
        if final is None or not final.finished:
            raise RemoteError(f"request {req.request_id}: {final.reason if final else 'no final item'}")
        trace = final.trace
        finish = "length" if len(tokens) >= req.max_tokens else "stop"
        return DriveResult(
            req.request_id, tuple(tokens), float(trace["ttft_s"]), time.monotonic() - t0, finish
        )

    async def generate_alone(self, url: str, req: DriveRequest) -> tuple[int, ...]:
        """One vLLM generating alone (no connector involved): the exactness reference."""
        return await generate_alone(
            self.http, url, self.model, req.prompt, req.sampling, deadline_s=req.deadline_s
        )

    async def close(self) -> None:
        if self._router is not None:
            await self._router.close()
        await self.http.aclose()


__all__ = ["DriveRequest", "DriveResult", "PddlinkError", "VllmDriver"]
