"""A router run whose leg raises an unexpected exception ends at once with a typed reason
(``leg_crashed: <call>: <exception>``), not at its deadline, and leaves nothing in flight.

Issue 16, case 1: values the router's checks let through made a conversion raise inside a leg's
background task that nobody awaited, and the request hung until its deadline (30 s) to answer 503
``deadline_exceeded``. The schema now refuses those values, so that conversion cannot be made to
raise for real any more: the gRPC test injects the fault (``router.legs.sampling_to_pb`` replaced
by one that raises what protobuf raises for an out-of-range field) -- a mock, allowed here because
the fault cannot be produced for real. Everything else is real: a ``Router``, its gRPC channels,
``router.leg_driver.LegDriver`` over ``GrpcCalls``, the asyncio driver. The vLLM tests need no
mock: a real HTTP server on loopback answers the leg's call with bytes the router cannot read (a
malformed SSE line, a reply without ``choices``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from engines_adapter.base import SamplingParams
from pddlink.lifecycle import RunOutcome, RunSpec
from pddlink.routing import Pipeline
from router import Router, RouterConfig, VllmEngineConfig
from router.answer import RequestEnd
from router.run import RunDriver, teardowns_pending

pytestmark = [pytest.mark.timeout(60)]

DEADLINE_S = 8.0
AT_ONCE_S = 1.0


async def _drain(gen: Any) -> tuple[list[dict[str, Any]], float]:
    t0 = time.monotonic()
    events = [ev async for ev in gen]
    return events, time.monotonic() - t0


@pytest.mark.parametrize("pipeline", ["p_md", "p_rld_md", "singular"])
def test_a_leg_that_raises_ends_the_request_at_once(monkeypatch: pytest.MonkeyPatch, pipeline: str) -> None:
    import router.legs

    def out_of_range(s: SamplingParams) -> Any:
        raise ValueError("Value out of range: -5")  # protobuf's words for stop_token_ids [-5]

    monkeypatch.setattr(router.legs, "sampling_to_pb", out_of_range)

    async def main() -> None:
        cfg = RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11", deadline_s=DEADLINE_S)
        r = Router(cfg)
        try:
            gen = r.generate([1, 2, 3], SamplingParams(max_tokens=4), pipeline=pipeline)
            events, took = await asyncio.wait_for(_drain(gen), DEADLINE_S + 5)
            end = events[-1]
            assert isinstance(end, RequestEnd) and end.outcome is RunOutcome.FAILED
            assert end.reason.startswith("leg_crashed: "), end.reason
            assert "ValueError: Value out of range: -5" in end.reason
            assert took < AT_ONCE_S, f"the request ended after {took:.2f} s (deadline {DEADLINE_S} s)"
            assert r.in_flight == {} and r.rld_active == 0
            await asyncio.sleep(0.5)
            assert teardowns_pending() == 0
        finally:
            await r.close()

    asyncio.run(main())


# -- vLLM's legs: a real HTTP server that answers with bytes the router cannot read ---------------

Answer = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[None]]


async def _serve(answer: Answer) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await answer(json.loads(await reader.readexactly(length)), writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _json(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def _sse(writer: asyncio.StreamWriter, lines: list[bytes]) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for c in lines:
        writer.write(f"{len(c):x}\r\n".encode() + c + b"\r\n")
        await writer.drain()
    await asyncio.sleep(DEADLINE_S + 5)  # then silence: only the router's own handling ends the call


async def sse_not_json(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    if body.get("stream"):
        await _sse(writer, [b'data: {"choices": [{"token_ids": [7]}]}\n\n', b'data: {"choices": [\n\n'])
    else:  # P's prefill: the first token
        writer.write(_json({"choices": [{"token_ids": [7], "finish_reason": "length"}]}))
        await writer.drain()


async def reply_without_choices(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    if body.get("stream"):
        await _sse(writer, [])  # MD says nothing
    else:
        writer.write(_json({"choices": []}))
        await writer.drain()


@pytest.mark.parametrize(
    ("answer", "crashed"),
    [(sse_not_json, "md1: JSONDecodeError"), (reply_without_choices, "p1: IndexError")],
    ids=["sse_not_json", "reply_without_choices"],
)
def test_a_vllm_leg_that_cannot_read_its_answer_ends_the_run_at_once(answer: Answer, crashed: str) -> None:
    from router.vllm_backend import VllmBackend
    from router.vllm_legs import vllm_legs
    from tests.sidecar.test_router_leg_driver import Cluster

    async def main() -> None:
        server, url = await _serve(answer)
        backend = VllmBackend(
            RouterConfig(engine="vllm", vllm=VllmEngineConfig(p_url=url, md_url=url, model="m"))
        )
        try:
            sampling = SamplingParams(max_tokens=4)  # no MD stall bound on vLLM (``VllmBackend``)
            spec = RunSpec(
                "r", (1, 2, 3), sampling, DEADLINE_S, Pipeline.P_MD, "test", 0.1, md_stall_s=math.inf
            )
            cluster = Cluster()
            driver = RunDriver(lambda d: vllm_legs(cluster, backend, d), spec, lambda now: False)
            t0 = time.monotonic()
            got = [tok async for tok in driver.run()]
            took = time.monotonic() - t0
            reason = driver.trace.reason_text
            assert reason.startswith(f"leg_crashed: {crashed}"), reason
            assert took < AT_ONCE_S, f"the run ended after {took:.2f} s (deadline {DEADLINE_S} s)"
            assert len(got) <= 1
            await asyncio.sleep(0.3)
            assert teardowns_pending() == 0
        finally:
            await backend.http.aclose()
            server.close()

    asyncio.run(main())
