"""``pddlink.serving.http_lent`` (issue 27): a large ``Content-Length`` body on a plaintext connection
reaches the handler unreceived. Whoever reads it (another reader from a duplicate of the socket, or
the server itself) gets exactly its bytes, and the connection's next request is served after it; a
body nobody read ends the connection; a TLS connection never lends.

Real sockets, on both event loops (the router runs on uvloop). The reader here is a thread with
``router.parse_worker.receive``, which the parse workers run; ``test_parse_processes`` has the
workers themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from pddlink.serving.http import HttpLimits, Request, Response, error_response, json_response, serve_http
from pddlink.serving.http_lent import BodyState
from pddlink.transport import PeerIdentity, load_or_create_pki
from router.parse_worker import Lost, receive

pytestmark = pytest.mark.timeout(30)

LIMITS = HttpLimits(max_body_bytes=2 << 20, lend_body_bytes=64 << 10, body_timeout_s=2.0, lend_paths=("/x",))
BODIES = [b"a" * 1_000_000, bytes(range(256)) * 4096, b"{}"]  # lent, lent, read
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])


def _wire(bodies: list[bytes]) -> bytes:
    head = b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
    return b"".join(head % len(b) + b for b in bodies)


def _digest(body: bytes) -> Response:
    return json_response(200, {"n": len(body), "sha": hashlib.sha256(body).hexdigest()})


def _exchange(port: int, wire: bytes, answers: int, ctx: ssl.SSLContext | None = None) -> bytes:
    """Send ``wire`` on one connection; what comes back until ``answers`` answers or the server
    closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        s = ctx.wrap_socket(raw) if ctx is not None else raw
        s.sendall(wire)
        got = b""
        while got.count(b"HTTP/1.1 ") < answers or not got.endswith(b"}\n"):
            part = s.recv(65536)
            if not part:
                break
            got += part
        return got


async def _serve(handler: Callable[[Request], Any], tls: ssl.SSLContext | None = None) -> tuple[int, Any]:
    servers = await serve_http(handler, host="127.0.0.1", port=0, limits=LIMITS, tls=tls)
    return servers[0].sockets[0].getsockname()[1], servers


@LOOPS
def test_bodies_received_by_another_reader_then_the_next_request(run: Callable[[Any], None]) -> None:
    """Two 1 MB bodies, each read from a duplicate of the socket by another thread, and a small
    request, back to back on one connection: every answer has its own body's digest."""
    seen: list[tuple[bool, BodyState, int]] = []

    async def handler(req: Request) -> Response:
        lent = req.lent
        if lent is None:
            return _digest(req.body)
        sock = lent.lend()
        try:
            got = await asyncio.to_thread(receive, sock, lent.first, lent.rest, lent.deadline)
        finally:
            if sock is not None:
                sock.close()
        lent.returned(not isinstance(got, Lost))
        seen.append((lent.lent_out, lent.state, len(lent.first)))
        assert isinstance(got, bytes), got
        return _digest(got)

    async def main() -> None:
        port, servers = await _serve(handler)
        got = await asyncio.to_thread(_exchange, port, _wire(BODIES), len(BODIES))
        for b in BODIES:
            assert hashlib.sha256(b).hexdigest().encode() in got
        assert got.count(b"HTTP/1.1 200") == 3 and b"connection: close" not in got.lower()
        assert [s[:2] for s in seen] == [(True, BodyState.READ)] * 2
        assert all(first < 1_000_000 for *_, first in seen)  # most of each came from the other reader
        for s in servers:
            s.close()

    run(main())


@LOOPS
def test_a_lent_body_read_here_is_the_body(run: Callable[[Any], None]) -> None:
    async def handler(req: Request) -> Response:
        return _digest(req.body if req.lent is None else await req.lent.read())

    async def main() -> None:
        port, servers = await _serve(handler)
        got = await asyncio.to_thread(_exchange, port, _wire(BODIES), len(BODIES))
        for b in BODIES:
            assert hashlib.sha256(b).hexdigest().encode() in got
        assert got.count(b"HTTP/1.1 200") == 3
        for s in servers:
            s.close()

    run(main())


@LOOPS
def test_a_body_nobody_read_ends_the_connection(run: Callable[[Any], None]) -> None:
    """Answered without reading its body: the answer says ``Connection: close``, the server closes,
    and the request sent after the body is not taken for a request."""
    calls: list[str] = []

    async def handler(req: Request) -> Response:
        calls.append("lent" if req.lent is not None else "read")
        return error_response(401, "no key")

    async def main() -> None:
        port, servers = await _serve(handler)
        t0 = time.monotonic()
        got = await asyncio.to_thread(_exchange, port, _wire(BODIES[:1] + BODIES[2:]), 2)
        assert got.count(b"HTTP/1.1 ") == 1 and b"HTTP/1.1 401" in got
        assert b"connection: close" in got.lower()
        assert calls == ["lent"] and time.monotonic() - t0 < 5
        for s in servers:
            s.close()

    run(main())


def test_a_body_that_stops_arriving_is_lost_by_its_deadline() -> None:
    """Half a body, then nothing: the reader gives up at the body's deadline, the connection ends."""
    outcome: list[Any] = []

    async def handler(req: Request) -> Response:
        assert req.lent is not None
        sock = req.lent.lend()
        got = await asyncio.to_thread(receive, sock, req.lent.first, req.lent.rest, req.lent.deadline)
        assert sock is not None
        sock.close()
        req.lent.returned(not isinstance(got, Lost))
        outcome.append(got)
        return error_response(408, "request body not received in time", "RequestTimeout")

    async def main() -> None:
        port, servers = await _serve(handler)

        def client() -> tuple[bytes, float]:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n" + b"a" * 300_000)
                t0, got = time.monotonic(), b""
                while part := s.recv(65536):
                    got += part
                return got, time.monotonic() - t0

        got, took = await asyncio.to_thread(client)
        assert b"HTTP/1.1 408" in got and b"connection: close" in got.lower()
        assert 1.5 < took < 5, took  # LIMITS.body_timeout_s is 2 s
        assert outcome == [Lost("request body not received in time")]
        for s in servers:
            s.close()

    uvloop.run(main())


def test_a_path_not_named_never_lends() -> None:
    """Only the paths in ``lend_paths`` get their bodies lent: any other handler reads ``body``."""
    lent: list[bool] = []

    async def handler(req: Request) -> Response:
        lent.append(req.lent is not None)
        return _digest(req.body if req.lent is None else await req.lent.read())

    async def main() -> None:
        port, servers = await _serve(handler)
        wire = _wire(BODIES[:1]).replace(b"POST /x ", b"POST /y ") + _wire(BODIES[:1])
        got = await asyncio.to_thread(_exchange, port, wire, 2)
        assert got.count(hashlib.sha256(BODIES[0]).hexdigest().encode()) == 2
        assert lent == [False, True]
        for s in servers:
            s.close()

    uvloop.run(main())


def test_a_tls_connection_never_lends(tmp_path: Path) -> None:
    router_id, client_id = PeerIdentity("router", "router0"), PeerIdentity("client", "c1")
    creds = load_or_create_pki(tmp_path / "pki", [router_id, client_id])
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(str(creds[router_id].cert_file), str(creds[router_id].key_file))
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname = False
    client_ctx.load_verify_locations(str(creds[client_id].ca_file))
    lent: list[bool] = []

    async def handler(req: Request) -> Response:
        lent.append(req.lent is not None)
        return _digest(req.body)

    async def main() -> None:
        port, servers = await _serve(handler, server_ctx)
        got = await asyncio.to_thread(_exchange, port, _wire(BODIES), len(BODIES), client_ctx)
        for b in BODIES:
            assert hashlib.sha256(b).hexdigest().encode() in got
        assert lent == [False, False, False]
        for s in servers:
            s.close()

    uvloop.run(main())


def test_a_lost_body_ends_the_connection_whatever_duplicate_is_left() -> None:
    """A reader that took a duplicate of the socket and never closed it (as a worker that died
    before taking it leaves it with ``multiprocessing``'s sharer): the client still sees the
    connection end after the answer."""
    left_open: list[socket.socket] = []

    async def handler(req: Request) -> Response:
        assert req.lent is not None
        sock = req.lent.lend()
        assert sock is not None
        left_open.append(sock)
        req.lent.returned(False)
        return error_response(503, "the process parsing this request stopped", "ServiceUnavailableError")

    async def main() -> None:
        port, servers = await _serve(handler)

        def client() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n" + b"a" * 100_000)
                got = b""
                while part := s.recv(65536):  # a connection left open: TimeoutError after 5 s
                    got += part
                return got

        try:
            got = await asyncio.to_thread(client)
            assert b"HTTP/1.1 503" in got and len(left_open) == 1 and left_open[0].fileno() >= 0
        finally:
            for sock in left_open:
                sock.close()
            for s in servers:
                s.close()

    uvloop.run(main())


@pytest.mark.parametrize("size", [1_000, 1_000_000], ids=["read", "lent"])
def test_a_client_that_expects_100_continue_is_told_to_go_on(size: int) -> None:
    """``Expect: 100-continue`` (curl sends it with bodies over 1 MB): the client hears ``100
    Continue`` before it sends the body, not after its own wait, and then the answer."""

    async def handler(req: Request) -> Response:
        return _digest(req.body if req.lent is None else await req.lent.read())

    async def main() -> None:
        port, servers = await _serve(handler)
        body = bytes(range(256)) * (size // 256)

        def client() -> tuple[bytes, bytes]:
            with socket.create_connection(("127.0.0.1", port), timeout=0.9) as s:  # curl waits 1 s
                s.sendall(
                    b"POST /x HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n"
                    % len(body)
                )
                interim = s.recv(65536)
                s.sendall(body)
                got = b""
                while not got.endswith(b"}\n"):
                    got += s.recv(65536)
                return interim, got

        try:
            interim, got = await asyncio.to_thread(client)
            assert interim.startswith(b"HTTP/1.1 100 ")
            assert b"HTTP/1.1 200" in got and hashlib.sha256(body).hexdigest().encode() in got
        finally:
            for s in servers:
                s.close()

    uvloop.run(main())


def test_a_client_waiting_for_100_continue_and_answered_unread_never_sends_its_body() -> None:
    """A lent body's ``100 Continue`` goes out only when its body is to be read: a request
    answered without reading it (here a 401) gets that answer instead, and the client, which sends
    nothing until told, has its connection closed without sending the body."""

    async def handler(req: Request) -> Response:
        assert req.lent is not None
        return error_response(401, "no key")

    async def main() -> None:
        port, servers = await _serve(handler)

        def client() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(
                    b"POST /x HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 1000000\r\n\r\n"
                )
                got = b""
                while part := s.recv(65536):
                    got += part
                return got

        try:
            got = await asyncio.to_thread(client)
            assert got.startswith(b"HTTP/1.1 401 ") and b"HTTP/1.1 100" not in got
        finally:
            for s in servers:
                s.close()

    uvloop.run(main())
