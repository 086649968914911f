"""One TCP (or TLS-over-TCP) connection carrying ``pddlink.wire`` frames, as an asyncio protocol.

Receiving: a ``BufferedProtocol`` over a ``FrameAssembler``: the kernel reads headers into a small
buffer and each chunk payload straight into a pooled buffer of its size, so the only copy of KV
bytes on the receive path is the kernel's. Each complete message goes to
``on_message(connection, message)``.

Sending: ``send(message)`` writes the encoded header+body and the payload memoryview with one
``writelines`` (no join, no copy in Python). The transport's write high-water mark is raised to
``LinkOptions.write_high_water_bytes``; ``wait_writable()`` blocks a writer while the kernel and
the transport buffer are full, always under a deadline.

Lifecycle: created by ``loop.create_connection``/``create_server`` -> ``connection_made`` tunes the
socket -> frames flow -> ``close()`` or a peer reset -> ``on_lost(connection, exc)`` exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
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
        self._lost = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.tag: Any = None  # owner's label (stream index, session)

    # -- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self.transport.set_write_buffer_limits(high=self._high_water, low=self._high_water // 4)
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

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        if not self.connected.done():
            self.connected.set_exception(ConnectionLost(f"connection failed: {exc}"))
        if not self._lost:
            self._lost = True
            self._on_lost(self, exc)

    def eof_received(self) -> bool:
        return False  # close our side too

    # -- send path -----------------------------------------------------------------------------

    def send(self, message: WireMessage) -> int:
        """Queue one frame for sending; returns its size on the wire. Never blocks."""
        if self._lost or self.transport is None or self.transport.is_closing():
            raise ConnectionLost("connection is closed")
        head, payload = encode_parts(message)
        if payload:
            self.transport.writelines((head, payload))
        else:
            self.transport.write(head)
        size = len(head) + len(payload)
        self.bytes_sent += size
        return size

    async def wait_writable(self, timeout_s: float) -> None:
        """Return when the write buffer is below its high-water mark (or the connection is gone)."""
        if self._writable.is_set():
            return
        try:
            await asyncio.wait_for(self._writable.wait(), timeout_s)
        except TimeoutError:
            raise ConnectionLost(f"connection not writable for {timeout_s:.1f} s") from None

    def write_buffer_size(self) -> int:
        return 0 if self.transport is None else self.transport.get_write_buffer_size()

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
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the connection now (used by tests and on protocol errors)."""
        if self.transport is not None:
            self.transport.abort()
        elif not self._lost:
            self._lost = True
            self._on_lost(self, exc)
