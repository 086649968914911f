"""A small HTTP/1.1 server on asyncio streams (h11 does the protocol): admin endpoints and the
router's OpenAI-style API. A handler gets a ``Request`` and returns a ``Response`` whose body is
bytes or an async iterator of bytes (sent chunked: server-sent events). One request per connection
at a time; keep-alive supported.

Bounded by ``HttpLimits``: the whole request head must arrive within ``header_timeout_s`` and the
whole body within ``body_timeout_s`` (total deadlines, not per read, so a client that trickles a
byte at a time is cut off); a body larger than ``max_body_bytes`` is refused with 413 as soon as
its ``Content-Length`` (or the bytes read so far) say so; request bodies buffered at once over
all connections stay under ``body_budget_bytes`` (503 with ``Retry-After`` beyond it), so many large
slow uploads cannot grow memory without bound. A chunked body is held to the same limit as its
chunk sizes are declared (``pddlink.serving.chunked``: a huge chunk size gets 413 at once).

A malformed request (a garbage request line, a header without a colon, a bad, repeated or
conflicting ``Content-Length``, a bad chunk, a NUL in the target, a head over 64 KiB) is answered
400 (431 for the head's size, 501 for an unknown transfer coding) with a JSON body and
``Connection: close``, as is a head or body that misses its deadline (408): the client hears why.
A new connection must send its first byte within ``first_byte_timeout_s``. An optional ``gate``
(``ConnectionGate``; ``pddlink.serving.conn_slots``) admits each new connection, possibly by closing
others that have not sent a request head, and refuses the rest at once, answered without reading
their request and closed (never held).

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
import itertools
import json
import math
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

import h11

from pddlink import metrics
from pddlink.serving.chunked import BodyTooLarge, ChunkSizes
from pddlink.serving.write_bound import SEND_BUFFER_BYTES, WRITE_STALL_S, WriteBound

MAX_BODY_BYTES = 8 << 20
READ_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 * 1024
DISCARD_S = 0.5  # after a refusal: how long the client's remaining bytes are read and dropped
LINGERING = 16  # refused connections at once that may linger (DISCARD_S); more are closed at once
LISTEN_BACKLOG = 1024  # a burst of connects waits in the kernel, not in SYN retransmits (1 s, 3 s, ...)


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
    first_byte_timeout_s: float = READ_TIMEOUT_S  # a new connection's first byte must come within this


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


class ConnectionGate(Protocol):
    """Admits connections and follows their phases (``pddlink.serving.conn_slots``); connections are
    named by an int. ``opened`` answers the connections to close to make room, or a refusal;
    ``headed`` may refuse a connection once its request head names the client."""

    def opened(self, conn: int, peer: str, now: float) -> tuple[int, ...] | Response: ...

    def headed(self, conn: int, peer: str, authorization: str | None, now: float) -> Response | None: ...

    def idled(self, conn: int, now: float) -> None: ...

    def closed(self, conn: int) -> None: ...


def json_response(status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(obj).encode() + b"\n", headers=headers)


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", retry_after_s: int = 0
) -> Response:
    """vLLM's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    headers = (("retry-after", str(retry_after_s)),) if retry_after_s else ()
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return json_response(status, body, headers)


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def closing_bytes(resp: Response) -> bytes:
    """A whole answer with ``Connection: close``, as bytes: what is written when the connection's
    HTTP state is no longer trusted (a malformed request, a refusal before or instead of reading)."""
    body = resp.body if isinstance(resp.body, bytes) else b""
    lines = [b"HTTP/1.1 %d %s" % (resp.status, reason_phrase(resp.status))]
    headers = [("content-type", resp.content_type), *resp.headers]
    headers += [("content-length", str(len(body))), ("connection", "close")]
    lines += [f"{k}: {v}".encode("latin-1") for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


_KINDS = {400: "BadRequestError", 408: "RequestTimeout", 413: "RequestEntityTooLarge", 431: "BadRequestError"}


def protocol_error(status: int, message: str) -> Response:
    return error_response(status, message, _KINDS.get(status, "BadRequestError"))


def head_problem(raw_head: bytes) -> str:
    """What h11 lets through (it merges repeated equal values) but a server in front of others must
    not (request smuggling): a repeated or listed ``Content-Length``, or one beside
    ``Transfer-Encoding``. ``raw_head``: the head's bytes as received. "" when the head is fine."""
    names: list[bytes] = []
    for line in raw_head.split(b"\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon:
            names.append(name.strip().lower())
            if names[-1] == b"content-length" and b"," in value:
                return "malformed request: a list in Content-Length"
    if names.count(b"content-length") > 1:
        return "malformed request: repeated Content-Length header"
    if b"content-length" in names and b"transfer-encoding" in names:
        return "malformed request: both Content-Length and Transfer-Encoding"
    return ""


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


@dataclass(slots=True)
class _Shared:
    """What the connections of one server share."""

    handler: Handler
    limits: HttpLimits
    budget: _Budget
    gate: ConnectionGate | None
    lingering: int = 0  # refused connections now reading the client's last bytes


class _Conn:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shared: _Shared, peer: str, cid: int
    ) -> None:
        self.reader, self.writer, self.shared = reader, writer, shared
        self.limits, self.handler, self.peer, self.cid = shared.limits, shared.handler, peer, cid
        self.gate = shared.gate if peer else None
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.tap: Callable[[bytes], None] | None = None  # sees each read's bytes (chunk sizes)
        self.head_raw = bytearray()  # the bytes received while the current head was read
        self.after_body: bytes | None = None  # what followed a body h11 did not see (``_sized_body``)
        self.head_started = False  # a byte of the current request head has arrived

    async def _read(self) -> bytes:
        data = await self.reader.read(65536)
        if self.tap is not None:
            self.tap(data)
        return data

    async def _next_event(self) -> Any:
        while True:
            ev = self.h11.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            self.h11.receive_data(await self._read())

    async def _send(self, ev: Any, bound: WriteBound | None = None) -> None:
        data = self.h11.send(ev)
        if data:
            await self._write(data, bound)

    async def _write(self, data: bytes, bound: WriteBound | None = None) -> None:
        self.writer.write(data)
        bound = bound or WriteBound(self.limits.write_stall_s)
        try:
            async with asyncio.timeout(bound.left(time.monotonic())):
                await self.writer.drain()
        except TimeoutError:
            self.writer.transport.abort()  # a graceful close would wait on the unread bytes
            metrics.WRITES_CUT.labels(api="http").inc()
            raise WriteCut(bound.reason(time.monotonic())) from None

    async def _head(self, first: bool) -> Any:
        """The next request head; the first byte must come within the first-byte timeout (a new
        connection) or the idle timeout (keep-alive), the whole head within the header timeout."""
        lim = self.limits
        self.head_raw[:] = self.h11.trailing_data[0]
        self.head_started = bool(self.head_raw)
        if not self.head_started:
            wait_s = min(lim.first_byte_timeout_s, lim.idle_timeout_s) if first else lim.idle_timeout_s
            data = await asyncio.wait_for(self.reader.read(65536), wait_s)
            self.head_started = bool(data)
            self.head_raw += data
            self.h11.receive_data(data)
        self.tap = self.head_raw.extend
        try:
            async with asyncio.timeout(lim.header_timeout_s):
                return await self._next_event()
        finally:
            self.tap = None

    async def _body(self, ev: h11.Request) -> bytes:
        lim = self.limits
        headers = dict(ev.headers)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > lim.max_body_bytes:
            raise _Refused(protocol_error(413, f"request body too large (limit {lim.max_body_bytes} bytes)"))
        if length is not None:
            return await self._sized_body(int(length))
        body = bytearray()
        try:
            if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                sizes = ChunkSizes(lim.max_body_bytes)
                sizes.feed(self.h11.trailing_data[0])  # what came with the head
                self.tap = sizes.feed
            async with asyncio.timeout(lim.body_timeout_s):
                while True:
                    part = await self._next_event()
                    if isinstance(part, h11.EndOfMessage):
                        return bytes(body)
                    if not isinstance(part, h11.Data):
                        raise _Refused(protocol_error(400, "malformed request body"))
                    if len(body) + len(part.data) > lim.max_body_bytes:
                        raise BodyTooLarge(len(body) + len(part.data), lim.max_body_bytes)
                    self._take(len(part.data))
                    body += part.data
        except BodyTooLarge as exc:
            self.shared.budget.give(len(body))
            raise _Refused(protocol_error(413, f"request body too large (limit {exc.limit} bytes)")) from None
        except BaseException:
            self.shared.budget.give(len(body))
            raise
        finally:
            self.tap = None

    async def _sized_body(self, size: int) -> bytes:
        """A ``Content-Length`` body, read straight from the stream, not through h11: its receive
        buffer copies a body several times over (measured: 7 ms per MB, on the event loop). h11
        never sees these bytes: the next request starts on a fresh h11 connection (``serve``)."""
        pre = self.h11.trailing_data[0]
        parts, got = [pre[:size]], min(size, len(pre))
        self.after_body = pre[size:]
        taken = 0
        try:
            self._take(got)
            taken = got
            async with asyncio.timeout(self.limits.body_timeout_s):
                while got < size:
                    part = await self.reader.read(min(size - got, 1 << 20))
                    if not part:
                        raise ConnectionError("the client left mid-body")
                    self._take(len(part))
                    taken += len(part)
                    parts.append(part)
                    got += len(part)
        except BaseException:
            self.shared.budget.give(taken)
            raise
        return b"".join(parts)

    def _take(self, n: int) -> None:
        """``n`` more body bytes buffered, or 503 when the server's budget is spent."""
        if not self.shared.budget.take(n):
            raise _Refused(
                error_response(
                    503,
                    "the server is buffering too many request bodies",
                    "server_busy",
                    self.limits.retry_after_s,
                )
            )

    async def serve(self) -> None:
        """Requests one after another until the client leaves, a limit ends the connection, or the
        request is malformed: then it is answered 400 (431, 413, 408, 501) and closed."""
        first = True
        while True:
            ev = await self._request_head(first)
            if ev is None:
                return
            first = False
            try:
                body = await self._body(ev)
            except _Refused as refused:
                return await self.refuse(refused.response)
            except h11.RemoteProtocolError as exc:
                return await self.refuse(protocol_error(400, f"malformed request body: {exc}"))
            except TimeoutError:
                return await self.refuse(protocol_error(408, "request body not received in time"))
            try:
                await self._dispatch(ev, body)
            finally:
                self.shared.budget.give(len(body))
            if self.h11.our_state is h11.MUST_CLOSE:
                return
            self._next_cycle()
            if self.gate is not None:
                self.gate.idled(self.cid, time.monotonic())

    def _next_cycle(self) -> None:
        if self.after_body is None:
            self.h11.start_next_cycle()
            return
        # the body went around h11 (``_sized_body``): a fresh one, given the bytes that followed it
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        if self.after_body:  # (b"" would tell h11 that the client closed)
            self.h11.receive_data(self.after_body)
        self.after_body = None

    async def _request_head(self, first: bool) -> h11.Request | None:
        """The next request's head, checked (and its connection counted against the client it
        names); None when the connection is to end (answered first when there is something to say)."""
        try:
            ev = await self._head(first)
        except h11.RemoteProtocolError as exc:
            await self.refuse(protocol_error(exc.error_status_hint, f"malformed request: {exc}"))
            return None
        except TimeoutError:
            if self.head_started:  # a partial head: say why; a silent connection just closes
                await self.refuse(protocol_error(408, "request head not received in time"))
            return None
        if not isinstance(ev, h11.Request):
            return None
        left = len(self.h11.trailing_data[0])  # the bytes after the head
        if problem := head_problem(bytes(self.head_raw[: len(self.head_raw) - left])):
            await self.refuse(protocol_error(400, problem))
            return None
        if self.gate is not None:
            auth = dict(ev.headers).get(b"authorization")
            refused = self.gate.headed(
                self.cid, self.peer, None if auth is None else auth.decode("latin-1"), time.monotonic()
            )
            if refused is not None:
                await self.refuse(refused)
                return None
        return ev

    async def refuse(self, resp: Response) -> None:
        """Answer ``resp`` with ``Connection: close`` whatever was read so far, then read and drop
        what the client still sends, briefly (so that closing does not reset the connection before
        the client has read the answer); beyond ``LINGERING`` such connections, close at once."""
        if resp.status in _KINDS:
            metrics.CLIENT_ERRORS.labels(api="http").inc()
        await self._write(closing_bytes(resp))
        if self.shared.lingering >= LINGERING:
            return
        self.shared.lingering += 1
        try:
            with contextlib.suppress(TimeoutError, ConnectionError, OSError):
                async with asyncio.timeout(DISCARD_S):
                    left = 16 << 20
                    while left > 0 and (data := await self.reader.read(65536)):
                        left -= len(data)
        finally:
            self.shared.lingering -= 1

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
            head = h11.Response(status_code=resp.status, headers=headers, reason=reason_phrase(resp.status))
            await self._send(head, bound)
            if resp.body:
                await self._send(h11.Data(data=resp.body), bound)
        else:
            headers.append(("cache-control", "no-cache"))
            head = h11.Response(status_code=resp.status, headers=headers, reason=reason_phrase(resp.status))
            body = resp.body
            try:
                await self._send(head, bound)
                async for chunk in body:
                    await self._send(h11.Data(data=chunk), bound)
            finally:
                aclose = getattr(body, "aclose", None)
                if aclose is not None:  # the client left or was cut mid-stream: its request is cancelled
                    await aclose()
        await self._send(h11.EndOfMessage(), bound)


class _Connections:
    """The open connections of one server, by id, so that the gate's evictions can close them."""

    def __init__(self) -> None:
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self.ids = itertools.count(1)

    def evict(self, conns: tuple[int, ...]) -> None:
        for cid in conns:
            writer = self.writers.pop(cid, None)
            if writer is not None:
                metrics.HTTP_EVICTED.inc()
                writer.transport.abort()  # head-less or idle: nothing of a request is lost


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
    shared = _Shared(handler, lim, _Budget(lim.body_budget_bytes), gate)
    conns = _Connections()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        addr = writer.get_extra_info("peername")
        peer = addr[0] if isinstance(addr, tuple) else ""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, lim.send_buffer_bytes)
        cid = next(conns.ids)
        conn = _Conn(reader, writer, shared, peer, cid)
        try:
            if conn.gate is not None:
                opened = conn.gate.opened(cid, peer, time.monotonic())
                if isinstance(opened, Response):
                    await conn.refuse(opened)
                    return
                conns.evict(opened)
            conns.writers[cid] = writer
            await conn.serve()
        except (TimeoutError, ConnectionError, h11.ProtocolError, ssl.SSLError):
            pass
        finally:
            conns.writers.pop(cid, None)
            if conn.gate is not None:
                conn.gate.closed(cid)
            writer.close()
            with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
                await asyncio.wait_for(writer.wait_closed(), 5.0)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # bytes the client never takes would keep the socket open

    servers = []
    if port is not None:
        servers.append(
            await asyncio.start_server(
                on_client, host or None, port, limit=1 << 16, ssl=tls, backlog=LISTEN_BACKLOG
            )
        )
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
