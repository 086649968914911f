"""One HTTP/1.1 connection of ``pddlink.serving.http``'s server: its requests read and answered one
after another (h11 parses heads; a ``Content-Length`` body is received into one buffer by the
connection's protocol, ``pddlink.serving.http_inbox.Inbox``; chunked ones go through h11 with
their declared sizes followed by ``pddlink.serving.chunked``), the limits of ``HttpLimits``
applied as the bytes arrive, and every refusal or malformed request answered in vLLM's error shape
with ``Connection: close`` (``Conn.refuse``). A large ``Content-Length`` body on a plaintext
connection may be handed to the handler unreceived (``pddlink.serving.http_lent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11

from pddlink import metrics
from pddlink.serving.chunked import BodyTooLarge, ChunkSizes
from pddlink.serving.http_inbox import Inbox
from pddlink.serving.http_lent import BodyState, LentBody
from pddlink.serving.http_types import (
    ConnectionGate,
    Handler,
    HttpLimits,
    Request,
    Response,
    error_response,
    reason_phrase,
)
from pddlink.serving.write_bound import WriteBound

MAX_HEAD_BYTES = 64 * 1024
DISCARD_S = 0.5  # after a refusal: how long the client's remaining bytes are read and dropped
LINGERING = 16  # refused connections at once that may linger (DISCARD_S); more are closed at once


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
class Budget:
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
class Shared:
    """What the connections of one server share."""

    handler: Handler
    limits: HttpLimits
    budget: Budget
    gate: ConnectionGate | None
    lingering: int = 0  # refused connections now reading the client's last bytes


class Conn:
    def __init__(self, inbox: Inbox, shared: Shared, peer: str, cid: int) -> None:
        self.io, self.shared = inbox, shared
        self.limits, self.handler, self.peer, self.cid = shared.limits, shared.handler, peer, cid
        self.gate = shared.gate if peer else None
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.tap: Callable[[bytes], None] | None = None  # sees each read's bytes (chunk sizes)
        self.head_raw = bytearray()  # the bytes received while the current head was read
        self.after_body: bytes | None = None  # what followed a body h11 did not see (``_sized_body``)
        self.head_started = False  # a byte of the current request head has arrived
        transport = inbox.transport
        # a body may be read by another process from the socket: not through TLS
        self.lendable = transport is not None and transport.get_extra_info("sslcontext") is None

    async def _read(self) -> bytes:
        data = await self.io.read()
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
        self.io.write(data)
        bound = bound or WriteBound(self.limits.write_stall_s)
        try:
            async with asyncio.timeout(bound.left(time.monotonic())):
                await self.io.drain()
        except TimeoutError:
            self.io.abort()  # a graceful close would wait on the unread bytes
            metrics.WRITES_CUT.labels(api="http").inc()
            raise WriteCut(bound.reason(time.monotonic())) from None

    async def _head(self, first: bool) -> Any:
        """The next request head; the first byte must come within the first-byte timeout (a new
        connection) or the idle timeout (keep-alive), the whole head within the header timeout."""
        self.io.expect_head(True)
        try:
            return await self._head_event(first)
        finally:
            self.io.expect_head(False)

    async def _head_event(self, first: bool) -> Any:
        lim = self.limits
        self.head_raw[:] = self.h11.trailing_data[0]
        self.head_started = bool(self.head_raw)
        if not self.head_started:
            wait_s = min(lim.first_byte_timeout_s, lim.idle_timeout_s) if first else lim.idle_timeout_s
            async with asyncio.timeout(wait_s):  # (``wait_for`` would run the read as a task of its own)
                data = await self.io.read()
            self.head_started = bool(data)
            self.head_raw += data
            self.h11.receive_data(data)
        self.tap = self.head_raw.extend
        try:
            async with asyncio.timeout(lim.header_timeout_s):
                return await self._next_event()
        finally:
            self.tap = None

    async def _body(self, ev: h11.Request) -> bytes | LentBody:
        lim = self.limits
        headers = dict(ev.headers)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > lim.max_body_bytes:
            raise _Refused(protocol_error(413, f"request body too large (limit {lim.max_body_bytes} bytes)"))
        size = int(length) if length is not None else -1
        lend = self.lendable and 0 < lim.lend_body_bytes <= size and self._path(ev) in lim.lend_paths
        # a client that waits for ``100 Continue`` (curl does, with bodies over 1 MB) is told to
        # send the body once it is to be read: a lent body's reader says so (a handler that
        # answers without reading it, a 401, spares the client sending it at all)
        go_on = b""
        if self.h11.they_are_waiting_for_100_continue:
            go_on = self.h11.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
            if not lend:
                await self._write(go_on)
        if lend:
            return self._lent_body(size, go_on)
        if size >= 0:
            return await self._sized_body(size)
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
        """A ``Content-Length`` body, received straight into one buffer of its size
        (``Inbox.read_body``), not through h11: its receive buffer copies a body several times over
        (measured: 7 ms per MB, on the event loop). The budget is charged the declared size at once:
        that buffer is held from the head on. h11 never sees these bytes: the next request starts on
        a fresh h11 connection (``serve``)."""
        pre = self.h11.trailing_data[0]
        self.after_body = pre[size:]
        self._take(size)
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await self.io.read_body(size, first=pre[:size])
        except BaseException:
            self.shared.budget.give(size)
            raise

    @staticmethod
    def _path(ev: h11.Request) -> str:
        return ev.target.partition(b"?")[0].decode("latin-1")

    def _lent_body(self, size: int, go_on: bytes) -> LentBody:
        """A ``Content-Length`` body left on the socket (``pddlink.serving.http_lent``): receiving
        stops here, what already arrived goes with it. Charged to the budget whole, as a read one.
        ``go_on``: the ``100 Continue`` to send before the body is read (b"": none)."""
        self._take(size)
        self.io.hold()
        pre = self.h11.trailing_data[0]
        self.after_body = pre[size:]
        first = pre[:size] + self.io.take(size - min(size, len(pre)))
        return LentBody(self.io, size, first, time.monotonic() + self.limits.body_timeout_s, go_on)

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
            lent = body if isinstance(body, LentBody) else None
            try:
                await self._dispatch(ev, body)
            except BaseException:
                if lent is not None and lent.state is not BodyState.READ:
                    lent.cut()  # (cancelled mid-read, or the answer failed): a lent duplicate ends too
                raise
            finally:
                self.shared.budget.give(body.size if isinstance(body, LentBody) else len(body))
            if lent is not None and lent.state is not BodyState.READ:
                await self._linger()  # where the next request would start is unknown: the end
                return lent.cut()
            if self.h11.our_state is h11.MUST_CLOSE:
                return
            if lent is not None:
                self.io.let_go()
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
        await self._linger()

    async def _linger(self) -> None:
        """Before closing, after a last answer: read and drop what the client still sends, briefly
        (``refuse``)."""
        self.io.let_go()
        if self.shared.lingering >= LINGERING:
            return
        self.shared.lingering += 1
        try:
            with contextlib.suppress(TimeoutError, ConnectionError, OSError):
                async with asyncio.timeout(DISCARD_S):
                    await self.io.discard(16 << 20)
        finally:
            self.shared.lingering -= 1

    async def _dispatch(self, ev: h11.Request, body: bytes | LentBody) -> None:
        target = ev.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in ev.headers)
        lent = body if isinstance(body, LentBody) else None
        data = b"" if isinstance(body, LentBody) else body
        req = Request(ev.method.decode("latin-1"), path, query, data, headers, self.peer, lent)
        try:
            resp = await self.handler(req)
        except Exception as exc:  # a handler bug answers 500 instead of dropping the connection
            resp = error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        if lent is not None and lent.state is not BodyState.READ:  # the connection ends with this answer
            closing = (*resp.headers, ("connection", "close"))
            resp = Response(resp.status, resp.body, resp.content_type, closing, resp.send_by)
        await self._respond(resp)

    async def _respond(self, resp: Response) -> None:
        if self.h11.our_state is not h11.SEND_RESPONSE:
            return  # the head was never read whole: nothing to answer on this connection
        headers = [("content-type", resp.content_type), *resp.headers]
        bound = WriteBound(self.limits.write_stall_s, resp.send_by)
        if isinstance(resp.body, bytes):
            headers.append(("content-length", str(len(resp.body))))
            head = h11.Response(status_code=resp.status, headers=headers, reason=reason_phrase(resp.status))
            # one write, so one segment to the client: the head, the body and its end
            data = self.h11.send(head) or b""
            if resp.body:
                data += self.h11.send(h11.Data(data=resp.body)) or b""
            data += self.h11.send(h11.EndOfMessage()) or b""
            return await self._write(data, bound)
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
