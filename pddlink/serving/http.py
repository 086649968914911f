"""A small HTTP/1.1 server on asyncio streams (h11 does the protocol): admin endpoints and the
router's OpenAI-style API. A handler gets a ``Request`` and returns a ``Response`` whose body is
bytes or an async iterator of bytes (sent chunked: server-sent events). One request per connection
at a time; keep-alive supported.

Bounded by ``HttpLimits``: the whole request head must arrive within ``header_timeout_s`` and the
whole body within ``body_timeout_s`` (total deadlines, not per read, so a client that trickles a
byte at a time is cut off); a body larger than ``max_body_bytes`` is refused with 413 as soon as
its ``Content-Length`` (or the bytes read so far) say so; request bodies buffered at once over
all connections stay under ``body_budget_bytes`` (503 with ``Retry-After`` beyond it), so many large
slow uploads cannot grow memory without bound. An optional ``gate`` admits or refuses each new
connection (caps per client and in total).

Answers are bounded too (``pddlink.serving.write_bound``): a write whose bytes the client does not take
within ``write_stall_s``, or after the response's ``send_by`` (the request's deadline + a grace),
cuts the connection (aborted, not flushed: a non-reader would keep a graceful close waiting) and
closes the streamed body, which cancels its request. Each connection's kernel send buffer is
fixed (``send_buffer_bytes``), so what an unread answer pins is bounded and a stall shows early.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11

from pddlink import metrics
from pddlink.serving.write_bound import SEND_BUFFER_BYTES, WRITE_STALL_S, WriteBound

MAX_BODY_BYTES = 8 << 20
READ_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_body_bytes: int = MAX_BODY_BYTES
    body_budget_bytes: int = 256 << 20
    header_timeout_s: float = READ_TIMEOUT_S
    body_timeout_s: float = READ_TIMEOUT_S
    idle_timeout_s: float = 60.0
    retry_after_s: int = 1
    write_stall_s: float = WRITE_STALL_S  # one write's bytes must be taken by the client within this
    send_buffer_bytes: int = SEND_BUFFER_BYTES  # each connection's kernel send buffer (SO_SNDBUF)


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()  # names in lower case
    peer: str = ""  # the client's address ("" on a unix socket)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes | AsyncIterator[bytes] = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = field(default=())
    send_by: float = math.inf  # monotonic time by which the client must have taken the whole answer


Handler = Callable[[Request], Awaitable[Response]]
Gate = Callable[[str], "Response | None"]


def json_response(status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(obj).encode() + b"\n", headers=headers)


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", retry_after_s: int = 0
) -> Response:
    headers = (("retry-after", str(retry_after_s)),) if retry_after_s else ()
    return json_response(status, {"error": {"message": message, "type": kind, "code": status}}, headers)


class WriteCut(TimeoutError):
    """The client did not take an answer's bytes in time: the connection was aborted."""


class _Refused(Exception):
    """Ends a connection after answering ``response`` (a limit was hit while reading)."""

    def __init__(self, response: Response) -> None:
        self.response = response


@dataclass(slots=True)
class _Budget:
    """Body bytes buffered now, over every connection of one server."""

    limit: int
    used: int = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class _Conn:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        limits: HttpLimits,
        budget: _Budget,
        peer: str,
    ) -> None:
        self.reader, self.writer, self.handler = reader, writer, handler
        self.limits, self.budget, self.peer = limits, budget, peer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)

    async def _next_event(self) -> Any:
        while True:
            ev = self.h11.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            self.h11.receive_data(await self.reader.read(65536))

    async def _send(self, ev: Any, bound: WriteBound | None = None) -> None:
        data = self.h11.send(ev)
        if data:
            self.writer.write(data)
            bound = bound or WriteBound(self.limits.write_stall_s)
            try:
                async with asyncio.timeout(bound.left(time.monotonic())):
                    await self.writer.drain()
            except TimeoutError:
                self.writer.transport.abort()  # a graceful close would wait on the unread bytes
                metrics.WRITES_CUT.labels(api="http").inc()
                raise WriteCut(bound.reason(time.monotonic())) from None

    async def _head(self) -> Any:
        lim = self.limits
        if not self.h11.trailing_data[0]:  # idle keep-alive: wait for the next request's first byte
            data = await asyncio.wait_for(self.reader.read(65536), lim.idle_timeout_s)
            self.h11.receive_data(data)
        async with asyncio.timeout(lim.header_timeout_s):
            return await self._next_event()

    async def _body(self, ev: h11.Request) -> bytearray:
        lim = self.limits
        length = dict(ev.headers).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > lim.max_body_bytes:
            raise _Refused(error_response(413, f"request body too large (limit {lim.max_body_bytes} bytes)"))
        body = bytearray()
        try:
            async with asyncio.timeout(lim.body_timeout_s):
                while True:
                    part = await self._next_event()
                    if isinstance(part, h11.EndOfMessage):
                        return body
                    if not isinstance(part, h11.Data):
                        raise _Refused(error_response(400, "malformed request body"))
                    if len(body) + len(part.data) > lim.max_body_bytes:
                        raise _Refused(
                            error_response(413, f"request body too large (limit {lim.max_body_bytes} bytes)")
                        )
                    if not self.budget.take(len(part.data)):
                        raise _Refused(
                            error_response(
                                503,
                                "the server is buffering too many request bodies",
                                "server_busy",
                                lim.retry_after_s,
                            )
                        )
                    body += part.data
        except BaseException:
            self.budget.give(len(body))
            raise

    async def serve(self) -> None:
        while True:
            ev = await self._head()  # TimeoutError: the connection closes without an answer
            if not isinstance(ev, h11.Request):
                return
            try:
                body = await self._body(ev)
            except _Refused as refused:
                await self._respond(refused.response)
                await self._discard()
                return
            except TimeoutError:
                await self._respond(error_response(408, "request body not received in time"))
                return
            try:
                await self._dispatch(ev, bytes(body))
            finally:
                self.budget.give(len(body))
            if self.h11.our_state is h11.MUST_CLOSE:
                return
            self.h11.start_next_cycle()

    async def _discard(self) -> None:
        """After refusing a body: read (and drop) what the client still sends, briefly, so that
        closing does not reset the connection before the client has read the answer."""
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            async with asyncio.timeout(1.0):
                left = 16 << 20
                while left > 0 and (data := await self.reader.read(65536)):
                    left -= len(data)

    async def refuse(self, resp: Response) -> None:
        """Answer the first request with ``resp`` without reading its body, then close."""
        if isinstance(await self._head(), h11.Request):
            await self._respond(resp)

    async def _dispatch(self, ev: h11.Request, body: bytes) -> None:
        target = ev.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in ev.headers)
        req = Request(ev.method.decode("latin-1"), path, query, body, headers, self.peer)
        try:
            resp = await self.handler(req)
        except Exception as exc:  # a handler bug answers 500 instead of dropping the connection
            resp = error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        await self._respond(resp)

    async def _respond(self, resp: Response) -> None:
        if self.h11.our_state is not h11.SEND_RESPONSE:
            return  # the head was never read whole: nothing to answer on this connection
        headers = [("content-type", resp.content_type), *resp.headers]
        bound = WriteBound(self.limits.write_stall_s, resp.send_by)
        if isinstance(resp.body, bytes):
            headers.append(("content-length", str(len(resp.body))))
            await self._send(h11.Response(status_code=resp.status, headers=headers), bound)
            if resp.body:
                await self._send(h11.Data(data=resp.body), bound)
        else:
            headers.append(("cache-control", "no-cache"))
            body = resp.body
            try:
                await self._send(h11.Response(status_code=resp.status, headers=headers), bound)
                async for chunk in body:
                    await self._send(h11.Data(data=chunk), bound)
            finally:
                aclose = getattr(body, "aclose", None)
                if aclose is not None:  # the client left or was cut mid-stream: its request is cancelled
                    await aclose()
        await self._send(h11.EndOfMessage(), bound)


async def serve_http(
    handler: Handler,
    *,
    host: str = "",
    port: int | None = None,
    unix: str = "",
    limits: HttpLimits | None = None,
    tls: ssl.SSLContext | None = None,
    gate: Gate | None = None,
    ungate: Callable[[str], None] | None = None,
) -> list[asyncio.Server]:
    """Listen on ``host:port`` (if port is not None; 0: any free port) and on the unix socket ``unix``.
    ``tls`` applies to the TCP port; ``gate(peer)`` may refuse a new TCP connection with a response."""
    lim = limits or HttpLimits()
    budget = _Budget(lim.body_budget_bytes)

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        addr = writer.get_extra_info("peername")
        peer = addr[0] if isinstance(addr, tuple) else ""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, lim.send_buffer_bytes)
        gated = False
        try:
            conn = _Conn(reader, writer, handler, lim, budget, peer)
            if gate is not None and peer:
                refused = gate(peer)
                if refused is not None:
                    await conn.refuse(refused)
                    return
                gated = True
            await conn.serve()
        except (TimeoutError, ConnectionError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            if gated and ungate is not None:
                ungate(peer)
            writer.close()
            with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
                await asyncio.wait_for(writer.wait_closed(), 5.0)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # bytes the client never takes would keep the socket open

    servers = []
    if port is not None:
        servers.append(await asyncio.start_server(on_client, host or None, port, limit=1 << 16, ssl=tls))
    if unix:
        servers.append(await asyncio.start_unix_server(on_client, unix, limit=1 << 16))
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
