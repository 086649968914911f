"""A client that stops reading its answer does not keep its request (issue 16, bounded resources).

The router's runs advance as their answer is written; a client that sends a streaming request and
then takes no bytes (a small socket receive buffer, or a small HTTP/2 window on gRPC, and an
answer long enough to fill every buffer on the way) left its write waiting for good: the run
never reached its deadline, its slot stayed taken (the next request from that client got 503) and
the router kept it in flight. Now the write is cut (``pddlink.serving.write_bound``): at the stall bound,
or at the request's deadline + 0.5 s, whichever comes first.

Real processes and sockets: P, RLD and MD sidecars (``harness.cluster``), and a router in this
process (its config: small write bounds, one request at a time) serving HTTP on a loopback port
and gRPC on another.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from harness.cluster import Cluster, ClusterSpec, NoWan
from pddlink.serving.client_guard import ApiConfig, ClientGuard
from pddlink.serving.grpc_tls import new_server
from pddlink.serving.http import serve_http
from pddlink.serving.rpc import stubs
from router import Router, RouterConfig
from router.api import RouterApi, RouterService

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

LONG = 4096  # output tokens: ~1.3 MB of SSE, far more than the socket buffers hold
PROMPT = list(range(1, 33))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(tmp_path_factory.mktemp("slow"), relay=True, tls=True, deadline_s=30.0)
    with Cluster(NoWan(), spec) as c:
        yield c


def _router_cfg(cluster: Cluster) -> RouterConfig:
    p = cluster.ports
    return RouterConfig(
        p=f"127.0.0.1:{p['p_grpc']}",
        rld=f"127.0.0.1:{p['rld_grpc']}",
        md=f"127.0.0.1:{p['md_grpc']}",
        tls_dir=cluster.tls_dir("router"),
        admission=False,
        deadline_s=30.0,
    )


def _serve(cluster: Cluster, api_cfg: ApiConfig, fn: Callable[[int, int, Router, ClientGuard], None]) -> None:
    """A router in this process: HTTP and gRPC (plaintext) on loopback ports; ``fn`` in a thread."""

    async def main() -> None:
        router = Router(_router_cfg(cluster))
        await router.start()
        guard = ClientGuard.from_config(api_cfg)
        api = RouterApi(router, api_cfg, guard=guard)
        servers = await serve_http(api.http, host="127.0.0.1", port=0, limits=api.http_limits())
        grpc_server, _ = new_server(None)
        stubs()[1].add_RouterServicer_to_server(RouterService(router, guard), grpc_server)
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        http_port = servers[0].sockets[0].getsockname()[1]
        try:
            await asyncio.to_thread(fn, http_port, grpc_port, router, guard)
        finally:
            for s in servers:
                s.close()
            await grpc_server.stop(0.5)
            await router.close()

    asyncio.run(main())


def _body(max_tokens: int, deadline_s: float, stream: bool = True) -> bytes:
    doc = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": stream, "deadline_s": deadline_s}
    return json.dumps({**doc, "pipeline": "p_md", "temperature": 0.0}).encode()


def _non_reader(port: int, body: bytes) -> socket.socket:
    """A connection that sends a streaming request and then reads nothing (4 KiB receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    s.sendall(head.encode() + body)
    return s


def _cut(s: socket.socket, timeout_s: float) -> bool:
    """True when the server has closed (or reset) the connection: what it had sent, then EOF."""
    s.settimeout(timeout_s)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _admitted(router: Router, guard: ClientGuard, timeout_s: float = 5.0) -> None:
    until = time.monotonic() + timeout_s
    while not (guard.active == 1 and len(router.in_flight) == 1):
        assert time.monotonic() < until, "the request was not admitted"
        time.sleep(0.01)


def _released_within(router: Router, guard: ClientGuard, timeout_s: float) -> float | None:
    """Seconds until the router holds nothing (nothing in flight, no slot taken), or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not router.in_flight and guard.active == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _complete(port: int, max_tokens: int) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", _body(max_tokens, 20.0, stream=False))
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _status(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/status")
        doc: dict[str, Any] = json.loads(conn.getresponse().read())
        return doc
    finally:
        conn.close()


def test_an_sse_client_that_stops_reading_is_cut_at_the_stall_bound(cluster: Cluster) -> None:
    """Write stall bound 1 s, deadline 60 s: the run is cancelled and the slot freed within seconds
    (the old code: in flight until the client reads, the next request refused with 503)."""
    cfg = ApiConfig(write_stall_s=1.0, max_concurrent_requests=1, rate_per_client_s=0)

    def check(http_port: int, _grpc: int, router: Router, guard: ClientGuard) -> None:
        assert _complete(http_port, 4)[0] == 200  # the engines warm, the slot free again
        s = _non_reader(http_port, _body(LONG, 60.0))
        try:
            _admitted(router, guard)  # streaming now
            took = _released_within(router, guard, 20.0)
            assert took is not None, f"still held: in flight {list(router.in_flight)}, slots {guard.active}"
            assert _cut(s, 5.0), "the connection stayed open"
        finally:
            s.close()
        status, doc = _complete(http_port, 4)  # the same client is admitted again
        assert status == 200 and doc["choices"][0]["finish_reason"] == "length", doc
        assert _status(http_port)["in_flight"] == {}

    _serve(cluster, cfg, check)


def test_an_sse_client_that_stops_reading_ends_by_its_deadline(cluster: Cluster) -> None:
    """Stall bound 60 s, the request's deadline 3 s: cut at 3 + 0.5 s (the old code never). The
    send buffer at its least, so the buffers are full well before the deadline."""
    cfg = ApiConfig(
        write_stall_s=60.0, send_buffer_bytes=4096, max_concurrent_requests=1, rate_per_client_s=0
    )

    def check(http_port: int, _grpc: int, router: Router, guard: ClientGuard) -> None:
        assert _complete(http_port, 4)[0] == 200
        t0 = time.monotonic()
        s = _non_reader(http_port, _body(LONG, 3.0))
        try:
            _admitted(router, guard)
            took = _released_within(router, guard, 10.0)
            assert took is not None, f"still held: in flight {list(router.in_flight)}, slots {guard.active}"
            assert _cut(s, 5.0)
            assert time.monotonic() - t0 < 3.0 + 1.0 + 1.0  # deadline + the 1 s + polling
        finally:
            s.close()
        assert _complete(http_port, 4)[0] == 200
        assert _status(http_port)["in_flight"] == {}

    _serve(cluster, cfg, check)


def test_a_grpc_client_that_stops_reading_is_cut(cluster: Cluster) -> None:
    """A Generate stream whose client reads one event, then nothing (a 1 KiB HTTP/2 window): the
    router's write waits on flow control; it is cut at the stall bound (DEADLINE_EXCEEDED), the run
    cancelled, the slot freed; the old code held all three until the client read again."""
    cfg = ApiConfig(write_stall_s=1.0, max_concurrent_requests=1, rate_per_client_s=0)
    pb2, pb2_grpc = stubs()
    opts = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]

    def request(max_tokens: int) -> Any:
        sampling = pb2.Sampling(seed=1, temperature=0.0, max_tokens=max_tokens)
        return pb2.GenerateRequest(prompt=PROMPT, sampling=sampling, deadline_s=60.0, pipeline="p_md")

    def check(_http: int, grpc_port: int, router: Router, guard: ClientGuard) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=opts) as channel:
            stub = pb2_grpc.RouterStub(channel)
            stream = stub.Generate(request(LONG), timeout=120)
            next(stream)  # streaming; then the client reads nothing
            _admitted(router, guard)
            took = _released_within(router, guard, 20.0)
            assert took is not None, f"still held: in flight {list(router.in_flight)}, slots {guard.active}"
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "answer cut" in (err.value.details() or "")
            events = list(stub.Generate(request(4), timeout=30))  # the client is admitted again
            assert events[-1].done and events[-1].outcome == "finished", events[-1]
        assert not router.in_flight and guard.active == 0

    _serve(cluster, cfg, check)
