"""One TCP (or TLS-over-TCP) connection carrying ``pddlink.wire`` frames, as an asyncio protocol.

Receiving: a ``BufferedProtocol``. Headers and bodies land in a small reusable buffer; a frame's
payload (a chunk, MiB order) is read by the kernel straight into a fresh buffer of its exact size,
so the only copy of KV bytes on the receive path is the kernel's. Each complete frame is decoded
by the wire module and handed to ``on_message(connection, message)``.

Sending: ``send(message)`` writes the encoded header+body and the payload memoryview with one
``writelines`` (no join, no copy in Python). The transport's write high-water mark is raised to
``LinkOptions.write_high_water_bytes``; ``wait_writable()`` blocks a writer while the kernel and
the transport buffer are full, always under a deadline.

Lifecycle: created by ``loop.create_connection``/``create_server`` -> ``connection_made`` tunes the
socket -> frames flow -> ``close()`` or a peer reset -> ``on_lost(connection, exc)`` exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

from pddlink.errors import ErrorCode, LocalError, PddlinkError
from pddlink.transport import sockopt
from pddlink.transport.buffers import RECEIVE_POOL
from pddlink.wire.codec import Decoder, encode_parts
from pddlink.wire.frame import HEADER_BYTES, MAGIC, FrameHeader, WireMessage, header_crc_ok, unpack_header

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
    ) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._cc = congestion_control
        self._high_water = write_high_water_bytes
        self._max_payload = max_payload_bytes
        self.transport: asyncio.Transport | None = None
        self.congestion_control = "unknown"
        self.connected = asyncio.get_running_loop().create_future()
        self._small = bytearray(_SMALL_BUFFER)
        self._small_len = 0  # valid bytes at the start of _small
        self._grow_to = 0
        self._decoder = Decoder(max_payload_bytes=max_payload_bytes)
        self._pending: WireMessage | None = None  # decoded head of a frame whose payload is arriving
        self._payload: bytearray | None = None
        self._payload_got = 0
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
            self.congestion_control = sockopt.tune_tcp_socket(sock, self._cc)
        if not self.connected.done():
            self.connected.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None:
            return memoryview(self._payload)[self._payload_got :]
        return memoryview(self._small)[self._small_len :]

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        try:
            if self._payload is not None:
                self._payload_got += nbytes
                if self._payload_got == len(self._payload):
                    self._finish_payload()
                    if self._small_len:
                        self._parse_small()
                return
            self._small_len += nbytes
            self._parse_small()
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

    # -- receive path --------------------------------------------------------------------------

    def _parse_small(self) -> None:
        """Take whole frames out of the small buffer; start a direct payload read for a large one."""
        view = memoryview(self._small)
        pos = 0
        while not self._lost and self._small_len - pos >= HEADER_BYTES:
            raw = view[pos : pos + HEADER_BYTES]
            magic, header = unpack_header(raw)
            if magic != MAGIC or not header_crc_ok(raw):
                self._decoder.feed(raw)  # raises the typed framing error
            head_len = HEADER_BYTES + header.body_len
            if header.payload_len < _DIRECT_PAYLOAD_BYTES:
                frame_len = head_len + header.payload_len
                if self._small_len - pos < frame_len:
                    self._reserve(frame_len)
                    break
                for message in self._decoder.feed(view[pos : pos + frame_len]):
                    self._on_message(self, message)
                pos += frame_len
                continue
            if self._small_len - pos < head_len:
                self._reserve(head_len)
                break
            message = self._decode_head(header, view[pos + HEADER_BYTES : pos + head_len])
            pos += head_len
            self._start_payload(message, header.payload_len, view[pos : self._small_len])
            pos = self._small_len if self._payload is not None else pos + header.payload_len
            if self._payload is not None:
                break  # the rest arrives straight into the payload buffer
        rest = self._small_len - pos
        if self._grow_to:
            grown = bytearray(self._grow_to)
            grown[:rest] = view[pos : self._small_len]
            self._small, self._grow_to = grown, 0
        elif pos and rest:
            self._small[:rest] = view[pos : self._small_len]
        view.release()
        self._small_len = rest

    def _reserve(self, frame_len: int) -> None:
        """Grow the small buffer for a frame whose header and body do not fit (a long block list)."""
        if frame_len > len(self._small):
            if frame_len > self._decoder.max_body_bytes + HEADER_BYTES + _DIRECT_PAYLOAD_BYTES:
                raise LocalError(f"frame of {frame_len} bytes exceeds the decoder's limits")
            self._grow_to = frame_len  # applied once no memoryview of the old buffer is alive

    def _decode_head(self, header: FrameHeader, body: memoryview) -> WireMessage:
        """Decode header+body through the wire decoder, announcing no payload (it comes separately)."""
        if header.payload_len > self._decoder.max_payload_bytes:
            raise LocalError(f"payload of {header.payload_len} bytes exceeds the decoder's limit")
        bare = dataclasses.replace(header, payload_len=0).pack()
        messages = self._decoder.feed(bare) + self._decoder.feed(body)
        if len(messages) != 1 or type(messages[0]).PAYLOAD_FIELD is None:
            raise LocalError("a frame with a payload did not decode to one payload-carrying message")
        return messages[0]

    def _start_payload(self, message: WireMessage, size: int, have: memoryview) -> None:
        buffer = RECEIVE_POOL.acquire(size)
        take = min(size, len(have))
        buffer[:take] = have[:take]
        self._pending, self._payload, self._payload_got = message, buffer, take
        if take == size:
            self._finish_payload()

    def _finish_payload(self) -> None:
        message, payload = self._pending, self._payload
        assert message is not None and payload is not None
        self._pending, self._payload, self._payload_got = None, None, 0
        field = type(message).PAYLOAD_FIELD or ""
        whole = dataclasses.replace(cast(Any, message), **{field: memoryview(payload).toreadonly()})
        self._on_message(self, whole)

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
