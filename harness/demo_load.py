"""Open-loop replay of the demo's requests against the router (gRPC over its unix socket).

Each request is sent at its arrival time whatever the others are doing; the client records its
own TTFT (send -> first token), the tokens with their source, and the router's trace. Progress goes
to a tqdm bar on stderr.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from harness.demo_workload import DemoRequest
from pddlink.serving.rpc import stubs
from pddlink.serving.sampling_pb import sampling_to_pb


@dataclass
class RequestResult:
    index: int
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    outcome: str = "failed"  # "finished" | "failed" | "rejected" (admission, at once)
    reason: str = ""
    trace: dict[str, Any] = field(default_factory=dict)


async def _one(
    stub: Any, pb2: Any, req: DemoRequest, deadline_s: float, pipeline: str, id_prefix: str
) -> RequestResult:
    res = RequestResult(req.index)
    msg = pb2.GenerateRequest(
        request_id=f"{id_prefix}{req.index}",
        prompt=list(req.prompt),
        sampling=sampling_to_pb(req.sampling),
        deadline_s=deadline_s,
        pipeline=pipeline,
    )
    t0 = time.monotonic()
    try:
        async for ev in stub.Generate(msg, timeout=deadline_s + 5.0):
            if ev.done:
                res.outcome, res.reason = ev.outcome, ev.reason
                res.trace = json.loads(ev.trace_json or "{}")
                break
            if res.ttft_s is None:
                res.ttft_s = time.monotonic() - t0
            res.tokens.append(ev.token_id)
            res.sources[ev.source] = res.sources.get(ev.source, 0) + 1
    except grpc.aio.AioRpcError as exc:
        res.reason = f"grpc {exc.code().name}: {exc.details()}"
        if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:  # admission said no at once
            res.outcome = "rejected"
            res.trace = {"option": "rejected"}
    res.e2e_s = time.monotonic() - t0
    return res


async def replay(
    target: str,
    requests: list[DemoRequest],
    *,
    deadline_s: float,
    pipeline: str = "",
    on_done: Callable[[RequestResult], None] | None = None,
    id_prefix: str = "d",
) -> list[RequestResult]:
    """``id_prefix`` keeps two replays' request ids apart (a warm-up's shipment that outlives its
    request must not land on a measured request of the same index)."""
    pb2, pb2_grpc = stubs()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb2_grpc.RouterStub(channel)
        start = time.monotonic()

        async def at_arrival(req: DemoRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
            res = await _one(stub, pb2, req, deadline_s, pipeline, id_prefix)
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(at_arrival(r) for r in requests)))
