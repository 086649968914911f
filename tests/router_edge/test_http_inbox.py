"""``pddlink.serving.http_inbox.Inbox`` (issue 27): a ``Content-Length`` body is received straight
into one buffer of its size (the buffer the event loop is handed is the body's own, never more
than what is left of it), bytes after a body wait for the next head, reading pauses while too
much is pending, and a client that leaves mid-body is an error, not a short body.

The protocol is driven as the event loop drives a ``BufferedProtocol`` (``get_buffer`` then
``buffer_updated``), with a transport that records what is asked of it; the last test serves
real sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from pddlink.serving.http import HttpLimits, Request, Response, json_response, serve_http
from pddlink.serving.http_inbox import HEAD_LOOKAHEAD, HIGH_WATER, SCRATCH_BYTES, Inbox
from pddlink.transport import PeerIdentity, load_or_create_pki


class _Transport:
    def __init__(self) -> None:
        self.paused = False
        self.closing = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> None:
        return None


async def _idle(_inbox: Inbox) -> None:
    return None


def _receive(inbox: Inbox, data: bytes, most: int = 1 << 30) -> list[int]:
    """``data`` as the loop receives it (up to ``most`` bytes a time); the sizes of the buffers
    the protocol handed out."""
    handed = []
    while data:
        buf = inbox.get_buffer(-1)
        handed.append(len(buf))
        n = min(len(buf), len(data), most)
        buf[:n] = data[:n]
        inbox.buffer_updated(n)
        data = data[n:]
    return handed


async def _inbox() -> tuple[Inbox, _Transport]:
    inbox, transport = Inbox(_idle), _Transport()
    inbox.connection_made(transport)  # type: ignore[arg-type]
    return inbox, transport


def test_a_body_is_received_into_its_own_buffer_and_nothing_past_it() -> None:
    async def main() -> None:
        inbox, _ = await _inbox()
        inbox.expect_head(False)  # (a head was read)
        body = bytes(range(256)) * 4000  # 1,024,000 bytes
        head_part, rest = body[:1000], body[1000:]
        reading = asyncio.create_task(inbox.read_body(len(body), first=head_part))
        await asyncio.sleep(0)  # the reader waits for the rest
        handed = _receive(inbox, rest + b"GET / HTTP/1.1\r\n\r\n", most=300_000)
        # while the body arrives, each buffer handed out is what is left of the body, exactly
        left = len(rest)
        for size in handed[:4]:
            assert size == left
            left -= min(size, 300_000)
        assert left == 0 and handed[4:] == [SCRATCH_BYTES]  # the next head: the scratch buffer
        assert await reading == body
        assert await inbox.read() == b"GET / HTTP/1.1\r\n\r\n"

    asyncio.run(main())


def test_pending_bytes_count_toward_the_body_and_reading_pauses_above_the_high_water_mark() -> None:
    async def main() -> None:
        inbox, transport = await _inbox()
        inbox.expect_head(False)
        data = b"x" * (HIGH_WATER + SCRATCH_BYTES)
        _receive(inbox, data, most=SCRATCH_BYTES)
        assert transport.paused  # more than HIGH_WATER waits: the loop stops reading
        assert await inbox.read_body(HIGH_WATER) == data[:HIGH_WATER]  # from what was pending
        assert not transport.paused
        assert await inbox.read(10) == b"x" * 10

    asyncio.run(main())


def _arrive(inbox: Inbox, transport: _Transport, data: bytes, piece: int) -> bytes:
    """``data`` arriving ``piece`` bytes at a time, received as a loop does: not while paused.
    What was left in the kernel."""
    while data and not transport.paused:
        buf = inbox.get_buffer(-1)
        n = min(len(buf), len(data), piece)
        buf[:n] = data[:n]
        inbox.buffer_updated(n)
        data = data[n:]
    return data


def test_while_a_head_is_awaited_little_is_received_ahead_of_it() -> None:
    """A new connection (or one between requests) receives at most ``HEAD_LOOKAHEAD`` bytes, in
    pieces or at once, and then only when the head's reader asks for more, so that what follows a
    head (a body another process may read from the socket) stays in the kernel; once the head is
    read, reading goes on in full."""

    async def main() -> None:
        inbox, transport = await _inbox()
        left = _arrive(inbox, transport, b"h" * (3 * HEAD_LOOKAHEAD), piece=1000)
        assert transport.paused and len(left) == 2 * HEAD_LOOKAHEAD  # the rest stays in the kernel
        assert len(await inbox.read()) == HEAD_LOOKAHEAD
        assert transport.paused  # handed over: nothing more is received until it is asked for
        reading = asyncio.ensure_future(inbox.read())
        await asyncio.sleep(0)
        assert not transport.paused and not reading.done()  # asked for with nothing pending
        assert _arrive(inbox, transport, left, piece=len(left)) == left[HEAD_LOOKAHEAD:]
        assert len(await reading) == HEAD_LOOKAHEAD and transport.paused
        inbox.expect_head(False)
        assert not transport.paused
        assert _receive(inbox, b"b" * SCRATCH_BYTES) == [SCRATCH_BYTES] and not transport.paused

    asyncio.run(main())


def test_a_client_leaving_mid_body_is_an_error() -> None:
    async def main() -> None:
        inbox, _ = await _inbox()
        reading = asyncio.create_task(inbox.read_body(100))
        await asyncio.sleep(0)
        _receive(inbox, b"y" * 60)
        inbox.eof_received()
        with pytest.raises(ConnectionError):
            await reading
        lost, _ = await _inbox()
        reading = asyncio.create_task(lost.read_body(100))
        await asyncio.sleep(0)
        lost.connection_lost(ConnectionResetError("reset"))
        with pytest.raises(ConnectionResetError):
            await reading

    asyncio.run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_large_bodies_and_a_pipelined_request_over_a_real_socket(
    run: Callable[[Any], None], tls: bool, tmp_path: Path
) -> None:
    """Two 1 MB bodies and a small request sent back to back on one keep-alive connection: each
    answered with its own body's digest (on both event loops, the router runs on uvloop; plain and
    TLS, as with ``api.http_mtls``)."""
    server_ctx: ssl.SSLContext | None = None
    client_ctx: ssl.SSLContext | None = None
    if tls:
        router_id, client_id = PeerIdentity("router", "router0"), PeerIdentity("client", "c1")
        creds = load_or_create_pki(tmp_path / "pki", [router_id, client_id])
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(str(creds[router_id].cert_file), str(creds[router_id].key_file))
        client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client_ctx.check_hostname = False
        client_ctx.load_verify_locations(str(creds[client_id].ca_file))

    async def handler(req: Request) -> Response:
        return json_response(200, {"n": len(req.body), "sha": hashlib.sha256(req.body).hexdigest()})

    async def main() -> None:
        servers = await serve_http(
            handler, host="127.0.0.1", port=0, limits=HttpLimits(max_body_bytes=2 << 20), tls=server_ctx
        )
        port = servers[0].sockets[0].getsockname()[1]
        bodies = [b"a" * 1_000_000, bytes(range(256)) * 4096, b"{}"]
        wire = b"".join(
            b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(b), b) for b in bodies
        )

        def client() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                s = client_ctx.wrap_socket(raw) if client_ctx is not None else raw
                s.sendall(wire)
                got = b""
                while got.count(b'"sha"') < len(bodies):
                    part = s.recv(65536)
                    if not part:
                        break
                    got += part
                return got

        got = await asyncio.to_thread(client)
        for b in bodies:
            assert hashlib.sha256(b).hexdigest().encode() in got
        assert got.count(b"HTTP/1.1 200") == 3
        for s in servers:
            s.close()

    run(main())
