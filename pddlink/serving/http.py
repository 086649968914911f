"""A small HTTP/1.1 server on asyncio streams (h11 does the protocol): admin endpoints and the
router's OpenAI-style API. A handler gets a ``Request`` and returns a ``Response`` whose body is
bytes or an async iterator of bytes (sent chunked: server-sent events). One request per connection
at a time; keep-alive supported.

Bounded by ``HttpLimits``: the whole request head must arrive within ``header_timeout_s`` and the
whole body within ``body_timeout_s`` (total deadlines, not per read, so a client that trickles a
byte at a time is cut off); a body larger than ``max_body_bytes`` is refused with 413 as soon as
its ``Content-Length`` (or the bytes read so far) say so; request bodies buffered at once over
all connections stay under ``body_budget_bytes`` (503 with ``Retry-After`` beyond it), so many large
slow uploads cannot grow memory without bound. A ``Content-Length`` body is received straight into
one buffer of its declared size (``pddlink.serving.http_inbox``: no copies or joins on the event
loop), so it is charged to the budget whole, from its head on; a chunked body as it arrives. A
chunked body is held to the same limit as its chunk sizes are declared (``pddlink.serving.chunked``:
a huge chunk size gets 413 at once).

A malformed request (a garbage request line, a header without a colon, a bad, repeated or
conflicting ``Content-Length``, a bad chunk, a NUL in the target, a head over 64 KiB) is answered
400 (431 for the head's size, 501 for an unknown transfer coding) with a JSON body and
``Connection: close``, as is a head or body that misses its deadline (408): the client hears why.
A new connection must send its first byte within ``first_byte_timeout_s``. An optional ``gate``
(``ConnectionGate``; ``pddlink.serving.conn_slots``) admits each new connection, possibly by closing
others that have not sent a request head, and refuses the rest at once, answered without reading
their request and closed (never held).

One connection's requests are read and answered by ``pddlink.serving.http_conn``. Answers are
bounded too (``pddlink.serving.write_bound``): a write whose bytes the client does not take
within ``write_stall_s``, or after the response's ``send_by`` (the request's deadline + a grace),
cuts the connection (aborted, not flushed: a non-reader would keep a graceful close waiting) and
closes the streamed body, which cancels its request. Each connection's kernel send buffer is
fixed (``send_buffer_bytes``), so what an unread answer pins is bounded and a stall shows early.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import socket
import ssl
import time

import h11

from pddlink import metrics
from pddlink.serving.http_conn import Budget, Conn, Shared
from pddlink.serving.http_inbox import Inbox
from pddlink.serving.http_types import (
    ConnectionGate,
    Handler,
    HttpLimits,
    Request,
    Response,
    error_response,
    json_response,
)

__all__ = [
    "ConnectionGate",
    "Handler",
    "HttpLimits",
    "Request",
    "Response",
    "error_response",
    "fetch",
    "json_response",
    "serve_http",
]

LISTEN_BACKLOG = 1024  # a burst of connects waits in the kernel, not in SYN retransmits (1 s, 3 s, ...)


class _Connections:
    """The open connections of one server, by id, so that the gate's evictions can close them."""

    def __init__(self) -> None:
        self.open: dict[int, Inbox] = {}
        self.ids = itertools.count(1)

    def evict(self, conns: tuple[int, ...]) -> None:
        for cid in conns:
            inbox = self.open.pop(cid, None)
            if inbox is not None:
                metrics.HTTP_EVICTED.inc()
                inbox.abort()  # head-less or idle: nothing of a request is lost


async def serve_http(
    handler: Handler,
    *,
    host: str = "",
    port: int | None = None,
    unix: str = "",
    limits: HttpLimits | None = None,
    tls: ssl.SSLContext | None = None,
    gate: ConnectionGate | None = None,
) -> list[asyncio.Server]:
    """Listen on ``host:port`` (if port is not None; 0: any free port) and on the unix socket ``unix``.
    ``tls`` applies to the TCP port; ``gate`` admits TCP connections (refused ones are answered at
    once, without reading their request, and closed)."""
    lim = limits or HttpLimits()
    shared = Shared(handler, lim, Budget(lim.body_budget_bytes), gate)
    conns = _Connections()

    async def on_client(inbox: Inbox) -> None:
        transport = inbox.transport
        assert transport is not None
        addr = transport.get_extra_info("peername")
        peer = addr[0] if isinstance(addr, tuple) else ""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, lim.send_buffer_bytes)
        cid = next(conns.ids)
        conn = Conn(inbox, shared, peer, cid)
        try:
            if conn.gate is not None:
                opened = conn.gate.opened(cid, peer, time.monotonic())
                if isinstance(opened, Response):
                    await conn.refuse(opened)
                    return
                conns.evict(opened)
            conns.open[cid] = inbox
            await conn.serve()
        except (TimeoutError, ConnectionError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            conns.open.pop(cid, None)
            if conn.gate is not None:
                conn.gate.closed(cid)
            transport.close()
            with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
                async with asyncio.timeout(5.0):
                    await asyncio.shield(inbox.closed)
            if transport.get_write_buffer_size():
                transport.abort()  # bytes the client never takes would keep the socket open

    loop = asyncio.get_running_loop()
    servers = []
    if port is not None:
        servers.append(
            await loop.create_server(
                lambda: Inbox(on_client), host or None, port, ssl=tls, backlog=LISTEN_BACKLOG
            )
        )
    if unix:
        servers.append(await loop.create_unix_server(lambda: Inbox(on_client), unix))
    return servers


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def fetch(
    addr: str, method: str, path: str, body: bytes = b"", timeout_s: float = 10.0, bearer: str = ""
) -> tuple[int, bytes]:
    """A blocking HTTP request to ``host:port`` or ``unix:/path`` (admin endpoints, CLI, tests);
    ``bearer``: a key sent as ``Authorization: Bearer``."""
    if addr.startswith("unix:"):
        conn: http.client.HTTPConnection = _UnixConnection(addr[5:], timeout_s)
    else:
        host, _, port = addr.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        headers = {"content-type": "application/json"}
        if bearer:
            headers["authorization"] = f"Bearer {bearer}"
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
