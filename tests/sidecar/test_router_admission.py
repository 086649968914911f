"""Honest admission over the router's real APIs: when no option can end a request before its
deadline (here: a 1 Mbit/s line with 100 MB already queued toward MD, and neither relay nor
recompute), the router answers at once, HTTP 503 with Retry-After and a typed reason, gRPC
RESOURCE_EXHAUSTED with the reason and retry-after in its metadata, and starts nothing. The same
request on an idle line is admitted (it then fails on the unreachable sidecars: not this test's
concern, only that admission let it through)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from typing import Any

import grpc
import pytest

from pddlink.routing import BacklogReport
from pddlink.serving.http import serve_http
from pddlink.serving.rpc import stubs
from router import Router, RouterConfig
from router.api import RouterApi, RouterService

PROMPT = list(range(1, 400))


def _router() -> Router:
    cfg = RouterConfig(
        p="127.0.0.1:9",
        rld="127.0.0.1:10",
        md="127.0.0.1:11",
        relay_enabled=False,
        recompute=False,
        line_mbit=1.0,
    )
    router = Router(cfg)
    # P reports 100 MB still to ship toward MD: ~800 s on this line
    router.link.observe_backlog(BacklogReport((("other", 100_000_000),), frozenset(), time.monotonic() + 60))
    return router


def _post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"}
    )
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"null")
    headers = {k.lower(): v for k, v in resp.getheaders()}
    conn.close()
    return resp.status, headers, data


@pytest.mark.timeout(60)
def test_http_rejects_with_503_retry_after_and_a_typed_reason() -> None:
    async def main() -> None:
        router = _router()
        servers = await serve_http(RouterApi(router).http, host="127.0.0.1", port=0)
        port = servers[0].sockets[0].getsockname()[1]
        try:
            for stream in (False, True):
                body = {"prompt": PROMPT, "max_tokens": 8, "deadline_s": 5.0, "stream": stream}
                t0 = time.monotonic()
                status, headers, answer = await asyncio.to_thread(_post, port, body)
                assert time.monotonic() - t0 < 2.0  # at once, not at the deadline
                assert status == 503, answer
                assert int(headers["retry-after"]) >= 1
                assert answer["error"]["type"] == "overloaded"
                assert set(answer["error"]) == {"message", "type", "param", "code"}  # vLLM's shape
                assert headers["pddlink-reject-reason"] == "deadline_unreachable"
            assert router.in_flight == {}
        finally:
            for s in servers:
                s.close()
            await router.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_grpc_rejects_with_resource_exhausted() -> None:
    pb2, pb2_grpc = stubs()

    async def main() -> None:
        router = _router()
        server = grpc.aio.server()
        pb2_grpc.add_RouterServicer_to_server(RouterService(router), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = pb2_grpc.RouterStub(ch).Generate(
                    pb2.GenerateRequest(prompt=PROMPT, sampling=pb2.Sampling(max_tokens=8), deadline_s=5.0),
                    timeout=5,
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "deadline_unreachable" in (err.value.details() or "")
                meta = dict(err.value.trailing_metadata() or ())
                assert (
                    meta["pddlink-reject-reason"] == "deadline_unreachable" and int(meta["retry-after"]) >= 1
                )
            assert router.in_flight == {}
        finally:
            await server.stop(0)
            await router.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_idle_line_admits_and_recompute_can_rescue_a_full_one() -> None:
    async def main() -> None:
        idle = Router(
            RouterConfig(p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11", relay_enabled=False)
        )
        decision, _ = idle.decide(tuple(PROMPT), 8, "", 5.0)
        assert decision.option is not None and decision.option.value == "ship"
        full = _router()
        rejected, _ = full.decide(tuple(PROMPT), 8, "", 5.0)
        assert rejected.option is None
        rescue = Router(
            RouterConfig(
                p="127.0.0.1:9", rld="127.0.0.1:10", md="127.0.0.1:11", relay_enabled=False, line_mbit=1.0
            )
        )
        rescue.link.observe_backlog(full.link._report)  # type: ignore[arg-type]
        decided, _ = rescue.decide(tuple(PROMPT), 8, "", 5.0)
        assert decided.option is not None and decided.option.value == "recompute"
        for r in (idle, full, rescue):
            await r.close()

    asyncio.run(main())
