"""How the router reads one vLLM completion stream (``router.vllm_legs.VllmCalls._stream``) when vLLM
fails the request mid-stream: vLLM's OpenAI server then sends one ``data: {"error": {...}}`` chunk
and ``[DONE]`` (``create_streaming_error_response`` in vLLM's serving code; a KV load that fails
under ``kv_load_failure_policy = "fail"`` ends a stream so). The stream must end FAILED with vLLM's
message, and the tokens before the error must have reached the inbox at their positions.

The server here is a real HTTP server on loopback that writes those bytes, not vLLM: a KV load that
fails after vLLM has started streaming cannot be made to happen on demand with real instances (the
fault tests meet it only by chance, which is how it was found: ``finish_reason_missing`` in CI)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(30)]

ERROR = {
    "error": {"message": "KV load failed for request cmpl-1", "type": "InternalServerError", "code": 500}
}


def _chunk(ids: list[int], finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


async def _serve(chunks: list[bytes]) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for c in chunks:
            writer.write(f"{len(c):x}\r\n".encode() + c + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read(chunks: list[bytes]) -> tuple[Any, list[Any]]:
    import time

    from pddlink.roles import Role
    from router import RouterConfig, VllmEngineConfig
    from router.leg_driver import LegRun
    from router.vllm_backend import VllmBackend
    from router.vllm_legs import VllmCalls

    server, url = await _serve(chunks)
    backend = VllmBackend(
        RouterConfig(engine="vllm", vllm=VllmEngineConfig(p_url=url, md_url=url, model="m"))
    )
    try:
        run = LegRun(None, time.monotonic() + 10)  # type: ignore[arg-type]
        closed = await VllmCalls(run, backend)._stream(Role.RLD, url, "r1", (5, 6, 7), {"prompt": [5, 6, 7]})
        got = []
        while not run.inbox.empty():
            got.append(run.inbox.get_nowait())
        return closed, got
    finally:
        await backend.http.aclose()
        server.close()


def test_an_error_chunk_ends_the_stream_failed_with_vllms_message() -> None:
    from router.vllm_legs import StreamEnd

    chunks = [_chunk([11]), _chunk([12]), f"data: {json.dumps(ERROR)}\n\n".encode(), b"data: [DONE]\n\n"]
    closed, got = asyncio.run(_read(chunks))
    assert closed.end is StreamEnd.FAILED, closed
    assert closed.detail == "vllm_error:KV load failed for request cmpl-1", closed
    assert [(t.position, t.token_id) for t in got] == [(3, 11), (4, 12)]


def test_a_stream_that_finishes_is_finished() -> None:
    from router.vllm_legs import StreamEnd

    closed, got = asyncio.run(_read([_chunk([11]), _chunk([12], "length"), b"data: [DONE]\n\n"]))
    assert closed.end is StreamEnd.FINISHED and closed.detail == "length", closed
    assert [t.token_id for t in got] == [11, 12] and got[-1].last
