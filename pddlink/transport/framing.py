"""One TCP (or TLS-over-TCP) connection carrying ``pddlink.wire`` frames, as an asyncio protocol.

Receiving: a ``BufferedProtocol`` over a ``FrameAssembler``: the kernel reads headers into a small
buffer and each chunk payload straight into a pooled buffer of its size, so the only copy of KV
bytes on the receive path is the kernel's. Each complete message goes to
``on_message(connection, message)``.

Sending: ``send(message)`` hands the encoded header+body and the payload memoryview to the
transport (no join, no copy in Python) while it is writable; while it is paused (its buffer over
the high-water mark) frames wait in ``send``'s own queue, as references to the caller's buffers,
and go out as it drains. The transport's write high-water mark is raised to
``LinkOptions.write_high_water_bytes`` (plaintext); ``wait_writable()`` blocks a writer while the
kernel and the transport buffer are full, always under a deadline.

Why the queue, and why TLS writes go in pieces under a low mark: asyncio's TLS transport encrypts
whatever it is given at once into OpenSSL's outgoing memory BIO, also while the socket beneath is
paused, and that BIO's buffer never shrinks: it keeps the largest backlog the connection ever had
for as long as the connection lives. Writing every frame of a congested WAN into it made a P keep
tens of MiB per connection after a burst or an outage (issue 16, chaos: ``malloc_mapped`` 45 ->
105 MiB in a quiet P with no Python object more, RSS x1.39 of its warm-up). Over TLS a write is
at most ``TLS_WRITE_BYTES`` and the transport pauses at ``TLS_HIGH_WATER_BYTES``, so the BIO stays
within about twice that; the kernel's socket buffer, not this one, keeps the line busy.

Lifecycle: created by ``loop.create_connection``/``create_server`` -> ``connection_made`` tunes the
socket -> frames flow -> ``close()`` or a peer reset -> ``on_lost(connection, exc)`` exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from pddlink.errors import ErrorCode, LocalError, PddlinkError
from pddlink.transport import sockopt
from pddlink.transport.assembler import FrameAssembler
from pddlink.wire.codec import encode_parts
from pddlink.wire.frame import WireMessage

log = logging.getLogger(__name__)

_SMALL_BUFFER = 256 * 1024
_DIRECT_PAYLOAD_BYTES = 64 * 1024  # payloads this large are read by the kernel into their own buffer
TLS_WRITE_BYTES = 256 << 10  # the most one write adds to a TLS connection's outgoing buffer
TLS_HIGH_WATER_BYTES = 256 << 10  # a TLS transport pauses its writer here (see the module docstring)


class ConnectionLost(LocalError):
    """The connection closed or failed under a transfer or a pending request."""

    code = ErrorCode.PEER_UNREACHABLE


OnMessage = Callable[["FrameConnection", WireMessage], None]
OnLost = Callable[["FrameConnection", BaseException | None], None]


class FrameConnection(asyncio.BufferedProtocol):
    """Frames in and out of one stream connection. Not thread safe; one event loop."""

    def __init__(
        self,
        on_message: OnMessage,
        on_lost: OnLost,
        *,
        congestion_control: str = "bbr",
        write_high_water_bytes: int = 16 << 20,
        max_payload_bytes: int = 256 << 20,
        idle_timeout_s: float = 60.0,
        pacing_bytes_per_s: float = 0.0,
    ) -> None:
        self._idle_timeout_s = idle_timeout_s
        self._pacing = pacing_bytes_per_s
        self._on_message = on_message
        self._on_lost = on_lost
        self._cc = congestion_control
        self._high_water = write_high_water_bytes
        self._max_payload = max_payload_bytes
        self.transport: asyncio.Transport | None = None
        self.congestion_control = "unknown"
        self.connected = asyncio.get_running_loop().create_future()
        self._frames = FrameAssembler(lambda message: on_message(self, message), max_payload_bytes)
        self._writable = asyncio.Event()
        self._writable.set()
        self._queue: deque[tuple[bytes | memoryview, ...]] = deque()  # frames waiting for a drain
        self._queued_bytes = 0
        self._piece_bytes = 0  # TLS: payloads go to the transport in pieces of this size
        self._lost = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.tag: Any = None  # owner's label (stream index, session)

    # -- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        high = self._high_water
        if transport.get_extra_info("ssl_object") is not None:  # see the module docstring
            high, self._piece_bytes = min(high, TLS_HIGH_WATER_BYTES), TLS_WRITE_BYTES
        self.transport.set_write_buffer_limits(high=high, low=high // 4)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self.congestion_control = sockopt.tune_tcp_socket(sock, self._cc, self._idle_timeout_s)
            if self._pacing > 0:
                sockopt.set_pacing_rate(sock, self._pacing)
        if not self.connected.done():
            self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._frames.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        if self._lost:
            return
        try:
            self._frames.buffer_updated(nbytes)
        except PddlinkError as exc:
            log.warning("closing connection: %s", exc.message)
            self.abort(exc)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        self._drop_queue()
        if not self.connected.done():
            self.connected.set_exception(ConnectionLost(f"connection failed: {exc}"))
        if not self._lost:
            self._lost = True
            self._on_lost(self, exc)

    def eof_received(self) -> bool:
        return False  # close our side too

    # -- send path -----------------------------------------------------------------------------

    def send(self, message: WireMessage) -> int:
        """Queue one frame for sending; returns its size on the wire. Never blocks: the frame goes
        to the transport now if it is writable, else after the frames before it, as it drains."""
        if self._lost or self.transport is None or self.transport.is_closing():
            raise ConnectionLost("connection is closed")
        head, payload = encode_parts(message)
        size = len(head) + len(payload)
        if not payload:
            self._queue.append((head,))
        elif not self._piece_bytes:
            self._queue.append((head, payload))
        else:
            view, step = memoryview(payload).cast("B"), self._piece_bytes
            self._queue.append((head,))
            self._queue.extend((view[i : i + step],) for i in range(0, len(view), step))
        self._queued_bytes += size
        self._flush()
        self.bytes_sent += size
        return size

    def _flush(self, *, all_of_it: bool = False) -> None:
        """Hand queued frames to the transport while it takes them (a write that crosses its
        high-water mark pauses it at once, from inside the write); ``all_of_it``: regardless."""
        transport = self.transport
        while self._queue and transport is not None and not self._lost:
            if not (all_of_it or self._writable.is_set()) or transport.is_closing():
                return
            parts = self._queue.popleft()
            self._queued_bytes -= sum(len(p) for p in parts)
            if len(parts) == 1:
                transport.write(parts[0])
            else:
                transport.writelines(parts)

    def _drop_queue(self) -> None:
        self._queue.clear()
        self._queued_bytes = 0

    async def wait_writable(self, timeout_s: float) -> None:
        """Return when the write buffer is below its high-water mark (or the connection is gone)."""
        if self._writable.is_set():
            return
        try:
            await asyncio.wait_for(self._writable.wait(), timeout_s)
        except TimeoutError:
            raise ConnectionLost(f"connection not writable for {timeout_s:.1f} s") from None

    def write_buffer_size(self) -> int:
        return self._queued_bytes + (0 if self.transport is None else self.transport.get_write_buffer_size())

    @property
    def lost(self) -> bool:
        return self._lost

    def socket(self) -> socket.socket | None:
        return None if self.transport is None else self.transport.get_extra_info("socket")

    def peer_certificate_der(self) -> bytes | None:
        ssl_object = None if self.transport is None else self.transport.get_extra_info("ssl_object")
        if ssl_object is None:
            return None
        der: bytes | None = ssl_object.getpeercert(binary_form=True)
        return der

    def close(self) -> None:
        """Close once what was sent has gone out (the transport flushes its buffer first)."""
        if self.transport is not None and not self.transport.is_closing():
            self._flush(all_of_it=True)
            self.transport.close()

    def reset(self) -> None:
        """Drop the connection with a TCP reset: what the kernel still queues for the peer is
        thrown away, never delivered (a link given up in an outage must not deliver its old
        requests once the WAN is back: TCP retransmits them for tens of seconds)."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.abort()

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the connection now (used by tests and on protocol errors)."""
        self._drop_queue()
        if self.transport is not None:
            self.transport.abort()
        elif not self._lost:
            self._lost = True
            self._on_lost(self, exc)
