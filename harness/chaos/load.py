"""The chaos suite's load: a bounded number of streaming requests, at most ``concurrency`` at once,
against the router's gRPC Generate (its unix socket), each recording what the invariants need:
start and end on one clock, every token with its position and source, the outcome and its reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from harness.demo_workload import DemoRequest
from pddlink.serving.rpc import stubs

CLIENT_SLACK_S = 5.0  # the client gives up this long after the deadline: a request still open then hung


@dataclass(slots=True)
class StreamResult:
    index: int
    pipeline: str  # asked for ("" = the router decides)
    started_s: float = 0.0  # on the run's clock (seconds since the load began)
    ended_s: float = 0.0
    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    outcome: str = ""  # finished | failed | refused | hung ("" until it ends)
    reason: str = ""
    trace: dict[str, Any] = field(default_factory=dict)

    @property
    def e2e_s(self) -> float:
        return self.ended_s - self.started_s


REFUSED_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}


async def _one(
    stub: Any, pb2: Any, req: DemoRequest, pipeline: str, deadline_s: float, t0: float
) -> StreamResult:
    res = StreamResult(req.index, pipeline, started_s=time.monotonic() - t0)
    s = req.sampling
    msg = pb2.GenerateRequest(
        request_id=f"c{req.index}",
        prompt=list(req.prompt),
        sampling=pb2.Sampling(
            seed=s.seed, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_tokens=s.max_tokens
        ),
        deadline_s=deadline_s,
        pipeline=pipeline,
    )
    try:
        async for ev in stub.Generate(msg, timeout=deadline_s + CLIENT_SLACK_S):
            if ev.done:
                res.outcome, res.reason = ev.outcome or "failed", ev.reason
                res.trace = json.loads(ev.trace_json or "{}")
                break
            res.positions.append(int(ev.position))
            res.tokens.append(int(ev.token_id))
            res.sources[ev.source] = res.sources.get(ev.source, 0) + 1
        else:
            res.outcome, res.reason = "failed", "stream closed without a closing event"
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            res.outcome, res.reason = "hung", f"no closing event {CLIENT_SLACK_S:g} s after the deadline"
        else:
            res.outcome = "refused" if code in REFUSED_CODES else "failed"
            res.reason = f"grpc_{code.name.lower()}: {exc.details()}"
    res.ended_s = time.monotonic() - t0
    return res


async def drive(
    target: str,
    requests: list[tuple[DemoRequest, str]],
    *,
    concurrency: int,
    deadline_s: float,
    t0: float,
    on_done: Callable[[StreamResult], None] | None = None,
    admit: Callable[[int], Awaitable[None]] | None = None,
) -> list[StreamResult]:
    """Every (request, pipeline) once, ``concurrency`` at a time (closed loop), results in order.
    ``admit(k)`` is awaited before the k-th request (in start order) is sent."""
    pb2, pb2_grpc = stubs()
    slots = asyncio.Semaphore(concurrency)
    issued = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb2_grpc.RouterStub(channel)

        async def run(req: DemoRequest, pipeline: str) -> StreamResult:
            nonlocal issued
            async with slots:
                k, issued = issued, issued + 1
                if admit is not None:
                    await admit(k)
                res = await _one(stub, pb2, req, pipeline, deadline_s, t0)
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(run(r, p) for r, p in requests)))
