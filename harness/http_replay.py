"""Open-loop replay of the demo's requests over the router's HTTP API (``/v1/completions``, token-id
prompts, ``"stream": true``, ``pddlink-trace: 1``): what a client behind a load balancer sends.

Same contract as ``harness.demo_load.replay`` (gRPC): each request goes at its arrival time, the
client records its own TTFT (send -> first token), the tokens with their sources, and the router's
trace (the last chunk's ``pddlink`` object). A refusal (HTTP 429/503) is ``rejected``; an error event
in the stream or a cut connection is ``failed`` with the reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from harness.demo_load import RequestResult
from harness.demo_workload import DemoRequest

UNTIL_EVERY_S = 0.25  # how often a paced replay looks at its ``until``


def completion_body(req: DemoRequest, deadline_s: float, pipeline: str) -> dict[str, Any]:
    s = req.sampling
    body: dict[str, Any] = {
        "prompt": list(req.prompt),
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "seed": s.seed,
        "stream": True,
        "return_token_ids": True,
        "deadline_s": deadline_s,
    }
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if pipeline:
        body["pipeline"] = pipeline
    return body


def _take(res: RequestResult, chunk: dict[str, Any], t0: float) -> None:
    """One server-sent event of the stream."""
    if "error" in chunk:
        res.outcome, res.reason = "failed", str(chunk["error"].get("message", "error"))
        return
    for choice in chunk.get("choices", []):
        ids = choice.get("token_ids") or []
        ext = choice.get("pddlink") or {}
        if ids and res.ttft_s is None:
            res.ttft_s = time.monotonic() - t0
        if ext.get("trace") is not None:  # the last chunk: the whole answer and the trace
            res.trace = ext["trace"]
            res.outcome = "finished"
        else:
            res.tokens.extend(int(t) for t in ids)
            for src in ext.get("sources", []):
                res.sources[src] = res.sources.get(src, 0) + 1


async def one(
    client: httpx.AsyncClient, url: str, req: DemoRequest, deadline_s: float, pipeline: str
) -> RequestResult:
    res = RequestResult(req.index)
    headers = {"pddlink-trace": "1"}
    t0 = time.monotonic()
    try:
        body = completion_body(req, deadline_s, pipeline)
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.outcome = "rejected" if r.status_code in (429, 503) else "failed"
                res.reason = f"HTTP {r.status_code}: {text[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    _take(res, json.loads(line[6:]), t0)
    except httpx.HTTPError as exc:
        res.outcome, res.reason = "failed", f"{type(exc).__name__}: {exc}"
    if res.outcome == "failed" and not res.reason:
        res.reason = "the stream ended without its last chunk"
    res.e2e_s = time.monotonic() - t0
    return res


async def replay_http(
    url: str,
    requests: list[DemoRequest],
    *,
    deadline_s: float,
    pipeline: str = "",
    on_done: Callable[[RequestResult], None] | None = None,
    on_sent: Callable[[DemoRequest], None] | None = None,
    until: Callable[[], bool] | None = None,
) -> list[RequestResult]:
    """Every request of ``requests`` at its arrival time to ``url`` (a router or a load balancer).
    ``until``: checked while waiting for the next arrival; once it answers True no further request
    is sent (a steady load for as long as something else runs), those sent still end."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    timeout = httpx.Timeout(deadline_s + 10.0, connect=5.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.monotonic()

        async def sent(req: DemoRequest) -> RequestResult:
            res = await one(client, url, req, deadline_s, pipeline)
            if on_done is not None:
                on_done(res)
            return res

        tasks: list[asyncio.Task[RequestResult]] = []
        for req in sorted(requests, key=lambda r: r.arrival_s):
            while (wait_s := start + req.arrival_s - time.monotonic()) > 0 and not (until and until()):
                await asyncio.sleep(min(wait_s, UNTIL_EVERY_S))
            if until is not None and until():
                break
            if on_sent is not None:
                on_sent(req)
            tasks.append(asyncio.create_task(sent(req)))
        return list(await asyncio.gather(*tasks))
