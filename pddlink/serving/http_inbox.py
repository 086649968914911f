"""One connection's transport as ``pddlink.serving.http_conn`` uses it: an asyncio
``BufferedProtocol`` (the event loop receives straight into the buffer it is handed) with the few
reads and writes an HTTP/1.1 server needs.

- ``read``: the next bytes (request heads, chunked bodies), received into one reused scratch
  buffer and kept in ``pending`` until read; reading pauses while more than ``HIGH_WATER`` bytes wait.
- ``read_body(size)``: a ``Content-Length`` body received straight into one buffer of its declared
  size (what was already pending is copied in first): no chunk objects, no joins, and the bytes
  handed on are that buffer itself (``io.BytesIO.getvalue`` returns its buffer without a copy once
  no view of it is left). Issue 27: with ``asyncio.StreamReader`` a 1 MB body was copied five times
  on the event loop (the loop's read, the reader's buffer, its read, the parts' join), ~3 ms per MB.
- ``discard(limit)``: drop what the client still sends (after a refusal), into the scratch buffer.
- ``expect_head(on)``: while a request head is awaited, receive at most ``HEAD_LOOKAHEAD`` ahead.
- ``hold()`` / ``let_go()``: stop and restart receiving whatever is pending (a body another process
  reads from the socket itself: ``pddlink.serving.http_lent``); ``take(n)``: up to ``n`` pending
  bytes, at once.
- ``write`` / ``drain``: the transport's writes with its flow control; ``closed``: set when the
  connection is gone.

End of input reads as ``b""``; a connection lost with an error raises it (as ``StreamReader`` does).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Coroutine
from typing import Any, cast

SCRATCH_BYTES = 64 * 1024  # one receive into the scratch buffer, at most
HIGH_WATER = 2 * SCRATCH_BYTES  # pending bytes beyond which reading pauses until they are read
# while a request head is awaited (``heading``): the most received ahead of the head's reader, and
# only as it asks (``read``). What follows a head may be a body another process reads from the
# socket (``pddlink.serving.http_lent``): what this process received of it must be handed over.
HEAD_LOOKAHEAD = 4 * 1024


class Inbox(asyncio.BufferedProtocol):
    """``on_open(inbox)`` runs as a task once the connection is made (it serves the connection)."""

    def __init__(self, on_open: Callable[[Inbox], Coroutine[Any, Any, None]]) -> None:
        self._on_open = on_open
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.pending = bytearray()  # received, not yet read
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._target: memoryview | None = None  # a body being received in place (``read_body``)
        self._got = 0  # bytes of ``_target`` filled
        self._dropping = False  # received bytes are dropped (``discard``)
        self._dropped = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._held = False  # ``hold``: reading stays paused until ``let_go``
        self._heading = True  # a request head is awaited (``expect_head``): small receives
        self._writing_paused = False
        self._drained: asyncio.Future[None] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- the protocol (called by the event loop) ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.task = asyncio.get_running_loop().create_task(self._on_open(self))
        self.task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        """A handler that failed unexpectedly: reported (as asyncio's streams do) and cut."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        task.get_loop().call_exception_handler(
            {"message": "unhandled exception serving an HTTP connection", "exception": exc, "protocol": self}
        )
        if self.transport is not None:
            self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._got :]
        if self._heading:  # at most HEAD_LOOKAHEAD pending, all receives together
            return self._scratch[: max(1, HEAD_LOOKAHEAD - len(self.pending))]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._got += nbytes
            if self._got >= len(self._target):
                self._target = None  # the loop may ask for a buffer again before the reader runs
                self._wake()
            return
        if self._dropping:
            self._dropped += nbytes
            self._wake()
            return
        self.pending += self._scratch[:nbytes]
        full = (len(self.pending) >= HEAD_LOOKAHEAD) if self._heading else (len(self.pending) > HIGH_WATER)
        if full:
            self._pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        # keep the transport open to answer a client that half-closed (TLS cannot: it closes)
        return self.transport is not None and self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if exc is not None:
            self._error = exc
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- what a connection's handler calls ------------------------------------------------------

    async def read(self, n: int = SCRATCH_BYTES) -> bytes:
        """Up to ``n`` bytes, once some have arrived; ``b""`` at the end of input."""
        while not self.pending:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._resume_reading()
            await self._wait()
        data = bytes(self.pending[:n])
        del self.pending[:n]
        if self._heading:  # a head's reader receives again only when it needs more
            self._pause_reading()
        else:
            self._resume_reading()
        return data

    async def read_body(self, size: int, first: bytes = b"") -> bytes:
        """Exactly ``size`` bytes, ``first`` (what was read with the head) then what arrives,
        received into one buffer; ``ConnectionError`` if the client leaves first. The caller bounds
        the wait (the body deadline)."""
        buf = io.BytesIO()
        if size:
            buf.seek(size - 1)
            buf.write(b"\0")  # the buffer at its full size, once
        view = buf.getbuffer()
        try:
            got = min(size, len(first))
            view[:got] = first[:got]
            more = min(size - got, len(self.pending))
            view[got : got + more] = self.pending[:more]
            del self.pending[:more]
            got += more
            self._resume_reading()
            if got < size:
                self._target, self._got = view, got
                while self._got < size:
                    if self._error is not None:
                        raise self._error
                    if self._eof:
                        raise ConnectionError("the client left mid-body")
                    await self._wait()
        finally:
            self._target = None
            view.release()
            del view
        return buf.getvalue()

    async def discard(self, limit: int) -> None:
        """Drop what arrives until the client stops sending or ``limit`` bytes (caller: a deadline)."""
        self._dropped = len(self.pending)
        self.pending.clear()
        self._resume_reading()
        self._dropping = True
        try:
            while not self._eof and self._dropped < limit:
                await self._wait()
        finally:
            self._dropping = False

    def expect_head(self, heading: bool) -> None:
        """A request head is awaited, or not. While it is, what arrives is received only as the
        head's reader asks for it (``read`` when nothing is pending), at most ``HEAD_LOOKAHEAD``
        at a time: what follows a head may be a body another process reads from the socket, and
        whatever this process received of it is copied and handed over."""
        self._heading = heading
        if not heading:
            self._resume_reading()

    def hold(self) -> None:
        """Receive nothing more until ``let_go``: the socket's next bytes stay in the kernel."""
        self._held = True
        self._pause_reading()

    def let_go(self) -> None:
        """Receive again (``hold``)."""
        self._held = False
        self._resume_reading()

    def take(self, n: int) -> bytes:
        """Up to ``n`` of the bytes received and not yet read, without waiting."""
        data = bytes(self.pending[:n])
        del self.pending[:n]
        self._resume_reading()
        return data

    def abort(self) -> None:
        """Close at once, unsent bytes dropped."""
        assert self.transport is not None
        self.transport.abort()

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        """Once the transport's buffer is below its high-water mark; ``ConnectionResetError`` when
        the connection is gone."""
        if self.closed.done():
            raise ConnectionResetError("connection lost")
        if not self._writing_paused:
            return
        self._drained = asyncio.get_running_loop().create_future()
        await self._drained
        if self.closed.done():
            raise ConnectionResetError("connection lost")

    # -- within ---------------------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _pause_reading(self) -> None:
        transport = self._open()
        if not self._reading_paused and transport is not None:
            self._reading_paused = True
            transport.pause_reading()

    def _resume_reading(self) -> None:
        transport = self._open()
        room = len(self.pending) <= (HEAD_LOOKAHEAD if self._heading else SCRATCH_BYTES)
        if self._reading_paused and not self._held and room and transport is not None:
            self._reading_paused = False
            transport.resume_reading()

    def _open(self) -> asyncio.Transport | None:
        """The transport, unless it is closing (uvloop's raise when paused or resumed then)."""
        t = self.transport
        return t if t is not None and not t.is_closing() else None
