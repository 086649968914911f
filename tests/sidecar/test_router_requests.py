"""Malformed client requests get a 4xx with a clear message and change nothing at the router.

A real router (its HTTP server on a loopback port, its gRPC service) in front of sidecar addresses
where nothing listens: a request that passed validation would try to reach them, so "nothing
changed" is checked as: no request id taken, nothing in flight, no link-model flow started.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from typing import Any

import grpc
import pytest

from router import Router, RouterConfig
from router.api import RouterApi, RouterService, parse_completion
from sidecar.http import serve_http
from sidecar.rpc import stubs

BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"prompt": [1, 2], "max_tokens": 4, "temprature": 0.5}', "unknown field(s): temprature"),
    (b'{"prompt": [], "max_tokens": 4}', "must not be empty"),
    (b'{"prompt": "", "max_tokens": 4}', "must not be empty"),
    (b'{"max_tokens": 4}', '"prompt" is required'),
    (b'{"prompt": [1, 2], "max_tokens": 10000000}', "max_tokens"),
    (b'{"prompt": [1, 2], "max_tokens": 5000}', "exceeds the limit 4096"),
    (b'{"prompt": [1, 2], "max_tokens": "8"}', '"max_tokens" must be int'),
    (b'{"prompt": [1, 99999]}', "token ids must be in"),
    (b'{"prompt": [1, 2], "temperature": -1}', "temperature"),
    (b'{"prompt": [1, 2], "pipeline": "fastest"}', "pipeline must be one of"),
]


def _post(port: int, body: bytes, path: str = "/v1/completions", method: str = "POST") -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"null")
    conn.close()
    return resp.status, data


@pytest.mark.timeout(60)
def test_malformed_requests_get_400_and_change_nothing() -> None:
    async def main() -> None:
        router = Router(RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:9", md="127.0.0.1:9"))
        servers = await serve_http(RouterApi(router).http, host="127.0.0.1", port=0)
        port = servers[0].sockets[0].getsockname()[1]
        ids_before = next(router.ids)
        try:
            for body, needle in BAD_BODIES:
                status, answer = await asyncio.to_thread(_post, port, body)
                assert status == 400, (body, answer)
                assert needle in answer["error"]["message"], (body, answer)
            status, _ = await asyncio.to_thread(_post, port, b"", "/v1/completions", "GET")
            assert status == 405
            status, _ = await asyncio.to_thread(_post, port, b"", "/nope", "GET")
            assert status == 404
            assert next(router.ids) == ids_before + 1  # no request id was taken
            assert router.in_flight == {} and router.link.estimate(0.0).flows_in_flight == 0
        finally:
            for s in servers:
                s.close()
            await router.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_grpc_generate_refuses_bad_request() -> None:
    pb2, pb2_grpc = stubs()

    async def main() -> None:
        router = Router(RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:9", md="127.0.0.1:9"))
        server = grpc.aio.server()
        pb2_grpc.add_RouterServicer_to_server(RouterService(router), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb2_grpc.RouterStub(ch)
                for prompt, max_tokens in (([], 4), ([1, 2], 100000)):
                    call = stub.Generate(
                        pb2.GenerateRequest(prompt=prompt, sampling=pb2.Sampling(max_tokens=max_tokens)),
                        timeout=5,
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in call:
                            pass
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert router.in_flight == {}
        finally:
            await server.stop(0)
            await router.close()

    asyncio.run(main())


def test_string_prompt_is_bytes_and_defaults() -> None:
    ids, sampling, stream, deadline_s, pipeline = parse_completion(b'{"prompt": "AB", "stream": true}')
    assert ids == [66, 67] and sampling.max_tokens == 16 and stream and deadline_s == 0.0 and pipeline == ""
