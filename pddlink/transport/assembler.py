"""Reassembling wire frames from a byte stream, with chunk payloads landing in pooled buffers.

``FrameAssembler`` is the receive half of a stream transport, sans-I/O: bytes go in through
``get_buffer()`` + ``buffer_updated(n)`` (asyncio's ``BufferedProtocol`` shape, so a TCP socket
reads straight into it) or through ``feed(data)`` (QUIC stream data). Headers and bodies collect in
a small reusable buffer and are decoded by ``pddlink.wire.Decoder``; a payload of at least
``_DIRECT_PAYLOAD_BYTES`` (a chunk) goes into its own buffer from ``RECEIVE_POOL``, filled directly
by the kernel read on TCP, so KV bytes are copied once and no fresh pages are faulted in. Errors
are the wire's typed errors (or ``LocalError`` for limits); after one the stream is unusable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

from pddlink.errors import LocalError
from pddlink.transport.buffers import RECEIVE_POOL
from pddlink.wire.codec import Decoder
from pddlink.wire.frame import HEADER_BYTES, MAGIC, FrameHeader, WireMessage, header_crc_ok, unpack_header

_SMALL_BUFFER = 256 * 1024
_DIRECT_PAYLOAD_BYTES = 64 * 1024  # payloads this large get their own (pooled) buffer


class FrameAssembler:
    """Bytes of one stream in, whole messages out through ``on_message`` (see module docstring)."""

    def __init__(self, on_message: Callable[[WireMessage], None], max_payload_bytes: int = 256 << 20) -> None:
        self._on_message = on_message
        self._small = bytearray(_SMALL_BUFFER)
        self._small_len = 0  # valid bytes at the start of _small
        self._grow_to = 0
        self._decoder = Decoder(max_payload_bytes=max_payload_bytes)
        self._pending: WireMessage | None = None  # decoded head of a frame whose payload is arriving
        self._payload: memoryview | None = None  # a pooled buffer's first payload_len bytes
        self._payload_got = 0

    def get_buffer(self) -> memoryview:
        """Where the next bytes of the stream go (the payload's rest while one is arriving)."""
        if self._payload is not None:
            return self._payload[self._payload_got :]
        return memoryview(self._small)[self._small_len :]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written at the start of the last ``get_buffer()``."""
        if self._payload is not None:
            self._payload_got += nbytes
            if self._payload_got == len(self._payload):
                self._finish_payload()
                if self._small_len:
                    self._parse_small()
            return
        self._small_len += nbytes
        self._parse_small()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take bytes that arrived elsewhere (QUIC stream data): one copy, into place."""
        view = memoryview(data).cast("B")
        while view:
            target = self.get_buffer()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            target.release()
            view = view[n:]
            self.buffer_updated(n)

    def _parse_small(self) -> None:
        """Take whole frames out of the small buffer; start a direct payload read for a large one."""
        view = memoryview(self._small)
        pos = 0
        while self._small_len - pos >= HEADER_BYTES:
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
                    self._on_message(message)
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
        whole = dataclasses.replace(cast(Any, message), **{field: payload.toreadonly()})
        self._on_message(whole)
