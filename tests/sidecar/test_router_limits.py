"""The router's client API under slow, large and unauthorised clients (issue 16, items 2-3).

Real sockets: a router's HTTP server in-process with small limits (timeouts of a second), and a
real router process with its default limits for the memory case (peak RSS from /proc).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness.cluster import free_port
from pddlink.serving.client_guard import ApiConfig, ClientGuard
from pddlink.serving.http import serve_http
from pddlink.serving.rpc import stubs
from router import Router, RouterConfig
from router.api import RouterApi, RouterService

KEY = "k-0123456789abcdef"
NOWHERE = {"p": "127.0.0.1:9", "rld": "127.0.0.1:10", "md": "127.0.0.1:11"}


def _serve(api_cfg: ApiConfig, fn: Any) -> None:
    async def main() -> None:
        router = Router(RouterConfig(**NOWHERE))
        api = RouterApi(router, api_cfg, guard=ClientGuard.from_config(api_cfg))
        servers = await serve_http(
            api.http, host="127.0.0.1", port=0, limits=api.http_limits(), gate=api.gate
        )  # fmt: skip
        port = servers[0].sockets[0].getsockname()[1]
        try:
            await asyncio.to_thread(fn, port, api)
        finally:
            for s in servers:
                s.close()
            await router.close()

    asyncio.run(main())


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes the connection before ``seconds`` pass."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(60)
def test_header_and_body_deadlines_are_totals_not_per_read() -> None:
    """A head trickled one line per 0.3 s is cut off at the 1 s head deadline (the old per-read
    timeout of 30 s kept it open); a body trickled a byte per 0.2 s gets 408 at the body deadline."""
    cfg = ApiConfig(header_timeout_s=1.0, body_timeout_s=1.0)

    def check(port: int, _api: RouterApi) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.3):
                try:
                    s.sendall(b"x-pad: 1\r\n")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        assert _closed_within(s, 6.0) and time.monotonic() - t0 < 4.0
        stop.set()
        s.close()

        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
        t0 = time.monotonic()
        s.settimeout(0.2)
        answer = b""
        for _ in range(40):
            try:
                s.sendall(b"{")
                answer += s.recv(4096)
                if answer:
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - t0 < 4.0
        s.close()

    _serve(cfg, check)


@pytest.mark.timeout(60)
def test_api_keys_rate_limit_and_caps_refuse_at_once() -> None:
    def check(port: int, api: RouterApi) -> None:
        def get(path: str, key: str | None) -> tuple[int, dict[str, str], Any]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            headers = {"authorization": f"Bearer {key}"} if key else {}
            conn.request("GET", path, headers=headers)
            r = conn.getresponse()
            out = r.status, dict(r.getheaders()), json.loads(r.read())
            conn.close()
            return out

        assert get("/v1/models", None)[0] == 401
        assert get("/v1/models", "k-wrong-wrong-wrong")[0] == 401
        assert get("/status", None)[0] == 401
        assert get("/healthz", None)[0] == 200  # liveness stays open
        status, _, models = get("/v1/models", KEY)
        assert status == 200 and models["data"][0]["id"] == "pddlink"

        def post(body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {KEY}"})
            r = conn.getresponse()
            out = r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
            conn.close()
            return out

        body = {"prompt": [1, 2, 3], "max_tokens": 2, "deadline_s": 1.0}
        # the router is at its cap of one concurrent request: the next is refused at once, typed
        assert api.guard.admit("someone", time.monotonic()) is None
        t0 = time.monotonic()
        status, headers, answer = post(body)
        assert status == 503 and headers["retry-after"] == "1" and time.monotonic() - t0 < 2.0
        assert answer["error"]["type"] == "ServiceUnavailableError"
        api.guard.release()
        # two requests per burst for this client, then 429 with Retry-After
        statuses = [post(body)[0] for _ in range(2)]
        assert 429 not in statuses
        status, headers, answer = post(body)
        assert (
            status == 429 and int(headers["retry-after"]) >= 1 and answer["error"]["type"] == "RateLimitError"
        )
        # connections: two per client. Strangers' head-less connections from the same address do
        # not count against a client with a key: the oldest is closed to make room (issue 27)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.2)
        assert get("/v1/models", KEY)[0] == 200
        assert _closed_within(held[0], 2.0)
        # two keyed keep-alive connections fill the key's cap: a third is answered 429 and closed
        kept = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(2)]
        for conn in kept:
            conn.request("GET", "/v1/models", headers={"authorization": f"Bearer {KEY}"})
            assert conn.getresponse().read() and True
        status, headers, answer = get("/v1/models", KEY)
        assert status == 429 and answer["error"]["message"] == "too many connections from this client"
        for conn in kept:
            conn.close()
        for s in held:
            s.close()
        time.sleep(0.2)
        assert get("/v1/models", KEY)[0] == 200

    keys = Path(__file__).parent / ".keys-test"
    keys.write_text(f"# test key\n{KEY}\n")
    try:
        cfg = ApiConfig(
            api_keys_file=str(keys), max_concurrent_requests=1, rate_per_client_s=0.01, rate_burst=2,
            max_connections_per_client=2,
        )  # fmt: skip
        _serve(cfg, check)
    finally:
        keys.unlink()


@pytest.mark.timeout(60)
def test_grpc_needs_the_api_key() -> None:
    pb2, pb2_grpc = stubs()

    async def main(keys: Path) -> None:
        router = Router(RouterConfig(**NOWHERE))
        server = grpc.aio.server()
        guard = ClientGuard.from_config(ApiConfig(api_keys_file=str(keys)))
        pb2_grpc.add_RouterServicer_to_server(RouterService(router, guard), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb2_grpc.RouterStub(ch)
                req = pb2.GenerateRequest(prompt=[1, 2], sampling=pb2.Sampling(max_tokens=2), deadline_s=1.0)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(req, timeout=10):
                        pass
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Status(pb2.StatusRequest(), timeout=10)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
                reply = await stub.Status(
                    pb2.StatusRequest(), timeout=10, metadata=(("authorization", f"Bearer {KEY}"),)
                )
                assert json.loads(reply.json)["role"] == "router"
        finally:
            await server.stop(0)
            await router.close()

    keys = Path(__file__).parent / ".keys-grpc"
    keys.write_text(f"{KEY}\n")
    try:
        asyncio.run(main(keys))
    finally:
        keys.unlink()


def _rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.timeout(180)
def test_forty_large_uploads_keep_the_router_small() -> None:
    """Issue 16, item 3: 40 connections each sending 7.9 MB took the router from 84 to 452 MB. Now a
    declared length over the limit is refused before reading, a chunked body at the limit, and
    the router's peak RSS grows by well under the bodies' size (40 x 7.9 MB = 316 MB)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pddlink.cli.main", "router", "--p", "127.0.0.1:9", "--rld", "127.0.0.1:10",
         "--md", "127.0.0.1:11", "--grpc-port", "0", "--http-port", str(port)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("READY")
        base = _rss_kb(proc.pid, "VmRSS")
        size = 7_900_000
        chunk = b"x" * 65536
        results: list[bytes] = []

        def upload(i: int) -> None:
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            if i % 2:
                s.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {size}\r\n\r\n".encode()
                )
            else:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            sent = 0
            try:
                while sent < size:
                    part = chunk if i % 2 else b"%x\r\n%s\r\n" % (len(chunk), chunk)
                    s.sendall(part)
                    sent += len(chunk)
                    time.sleep(0.002)
            except OSError:
                pass  # refused and closed while we were still sending: what should happen
            try:
                results.append(s.recv(200))
            except OSError:
                results.append(b"")
            s.close()

        threads = [threading.Thread(target=upload, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        peak = _rss_kb(proc.pid, "VmHWM")
        answered = [r for r in results if r]
        assert answered and all(r.startswith(b"HTTP/1.1 413") for r in answered), answered[:3]
        assert (peak - base) / 1024 < 48, f"router peak RSS grew {(peak - base) / 1024:.0f} MB"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.timeout(60)
def test_http_mtls_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    """With ``api.http_mtls`` the HTTP port takes TLS 1.3 and only clients holding a certificate
    of the deployment's CA; a client with one gets the API."""
    import ssl

    from pddlink.transport import PeerIdentity, load_or_create_pki

    pki = tmp_path / "pki"
    router_id, client_id = PeerIdentity("router", "router0"), PeerIdentity("client", "c1")
    creds = load_or_create_pki(pki, [router_id, client_id])
    me = creds[client_id]
    # one shared directory (CA and peers together), or one node directory per identity
    tls_dir = node_dir if (node_dir := pki / "router-router0").is_dir() else pki

    async def main() -> None:
        router = Router(RouterConfig(**NOWHERE, tls_dir=str(tls_dir)))
        api = RouterApi(router, ApiConfig(http_mtls=True))
        assert router.tls is not None
        servers = await serve_http(api.http, host="127.0.0.1", port=0, tls=router.tls.server_context())
        port = servers[0].sockets[0].getsockname()[1]

        def call(with_cert: bool) -> int:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.load_verify_locations(str(me.ca_file))
            if with_cert:
                ctx.load_cert_chain(str(me.cert_file), str(me.key_file))
            conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ctx)
            try:
                conn.request("GET", "/v1/models")
                return conn.getresponse().status
            finally:
                conn.close()

        try:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.to_thread(call, False)
            assert await asyncio.to_thread(call, True) == 200
        finally:
            for s in servers:
                s.close()
            await router.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_grpc_over_the_cap_is_refused_at_once_with_retry_after() -> None:
    pb2, pb2_grpc = stubs()

    async def main() -> None:
        router = Router(RouterConfig(**NOWHERE))
        guard = ClientGuard(ApiConfig(max_concurrent_requests=1, retry_after_s=2))
        server = grpc.aio.server()
        pb2_grpc.add_RouterServicer_to_server(RouterService(router, guard), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        assert guard.admit("other", time.monotonic()) is None  # the one slot is taken
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb2_grpc.RouterStub(ch)
                req = pb2.GenerateRequest(prompt=[1, 2], sampling=pb2.Sampling(max_tokens=2), deadline_s=20.0)
                t0 = time.monotonic()
                call = stub.Generate(req, timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 3.0
                assert dict(await call.trailing_metadata())["retry-after"] == "2"
            assert guard.active == 1 and router.in_flight == {}
        finally:
            await server.stop(0)
            await router.close()

    asyncio.run(main())
