"""Frame encoder and the sans-I/O streaming frame decoder.

Encoding: ``Encoder.encode_parts(msg)`` returns ``(header + body, payload)`` so a transport can
``writev`` both without joining them (the payload, e.g. a MiB-sized chunk, is never copied);
``encode(msg)`` joins them for small messages and tests.

Decoding (h11 style): ``Decoder.receive_data(bytes)`` as bytes arrive, then ``next_message()``
until it returns None (more bytes needed). Any split of the stream gives the same messages. The
decoder buffers at most one header + body (bounded by ``max_body_bytes``); a payload goes straight
into its own buffer, grown as bytes arrive up to ``payload_len`` (bounded by ``max_payload_bytes``;
a header alone reserves nothing), and the message gets a read-only memoryview of it. On the first
bad frame the messages decoded before it are still delivered, then ``next_message`` raises the
``WireError`` (typed, see ``wire.errors``) and keeps raising it: the stream has lost its framing
and the connection must close.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any

from pddlink.errors import InvalidInput
from pddlink.wire.errors import (
    BadChecksum,
    BadFlags,
    BadMagic,
    DecoderBroken,
    FrameTooLarge,
    MalformedMessage,
    UnknownMessageType,
    VersionMismatch,
    WireError,
)
from pddlink.wire.fields import BodyReader, FieldCodec
from pddlink.wire.frame import (
    HEADER_BYTES,
    MAGIC,
    MESSAGE_TYPES,
    VERSION_FREE_TYPES,
    WIRE_VERSION,
    FrameHeader,
    WireMessage,
    header_crc_ok,
    unpack_header,
)

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 2**20
_U32_MAX = 2**32 - 1
_BODY_FIELDS: dict[type[Any], tuple[tuple[str, FieldCodec[Any]], ...]] = {}


def _body_fields(cls: type[WireMessage]) -> tuple[tuple[str, FieldCodec[Any]], ...]:
    fields = _BODY_FIELDS.get(cls)
    if fields is None:
        skip = (cls.STREAM_FIELD, cls.PAYLOAD_FIELD)
        fields = _BODY_FIELDS[cls] = tuple((n, c) for n, c in cls.WIRE_FIELDS if n not in skip)
    return fields


class Encoder:
    """Turns messages into frames. Stateless apart from the wire version it stamps."""

    def __init__(self, version: int = WIRE_VERSION) -> None:
        self.version = version

    def encode_parts(self, msg: WireMessage) -> tuple[bytes, bytes | memoryview]:
        """``(header + body, payload)``; ``payload`` is the message's own buffer (empty if none)."""
        cls = type(msg)
        if not isinstance(msg, WireMessage) or MESSAGE_TYPES.get(int(cls.WIRE_TYPE)) is not cls:
            raise InvalidInput(f"{cls.__name__} is not a registered wire message")
        body = bytearray()
        for name, codec in _body_fields(cls):
            codec.write(body, getattr(msg, name))
        payload: bytes | memoryview = b"" if cls.PAYLOAD_FIELD is None else getattr(msg, cls.PAYLOAD_FIELD)
        if len(body) > _U32_MAX or len(payload) > _U32_MAX:
            raise FrameTooLarge(f"{cls.__name__} does not fit one frame")
        header = FrameHeader(
            self.version, int(cls.WIRE_TYPE), 0, msg.stream_id, len(body), len(payload), zlib.crc32(body)
        )
        return header.pack() + bytes(body), payload

    def encode(self, msg: WireMessage) -> bytes:
        """The whole frame as one bytes object (copies the payload: not for chunks on the hot path)."""
        head, payload = self.encode_parts(msg)
        return head + payload if payload else head


_ENCODER = Encoder()
encode_parts = _ENCODER.encode_parts
encode = _ENCODER.encode


class Decoder:
    """Bytes in, messages out; see the module docstring for the contract."""

    def __init__(
        self,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        version: int = WIRE_VERSION,
    ) -> None:
        if max_body_bytes <= 0 or max_payload_bytes < 0:
            raise InvalidInput("decoder limits must be positive")
        self.max_body_bytes = max_body_bytes
        self.max_payload_bytes = max_payload_bytes
        self.version = version
        self._buf = bytearray()
        self._header: FrameHeader | None = None
        self._pending: tuple[type[WireMessage], dict[str, Any]] | None = None  # waits for its payload
        self._payload: bytearray | None = None  # grows as bytes arrive: a header alone reserves nothing
        self._payload_len = 0
        self._ready: deque[WireMessage] = deque()
        self._error: WireError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for the frame being assembled (header, body and payload so far)."""
        return len(self._buf) + (len(self._payload) if self._payload is not None else 0)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Take more bytes of the stream. Never raises for bad frames (see ``next_message``)."""
        if self._error is not None:
            raise DecoderBroken(f"decoder already failed: {self._error.message}")
        view = memoryview(data)
        if not view.contiguous:
            raise InvalidInput("Decoder.receive_data needs a contiguous buffer")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        try:
            while view:
                view = self._fill_payload(view) if self._payload is not None else self._fill_frame(view)
        except WireError as exc:
            self._error = exc
            self._buf = bytearray()
            self._payload = None
            self._pending = None

    def next_message(self) -> WireMessage | None:
        """The next complete message, None when more bytes are needed; raises after a bad frame."""
        if self._ready:
            return self._ready.popleft()
        if self._error is not None:
            raise self._error
        return None

    def feed(self, data: bytes | bytearray | memoryview) -> list[WireMessage]:
        """``receive_data`` and drain: every message completed by ``data`` (raises on a bad frame)."""
        self.receive_data(data)
        out: list[WireMessage] = []
        while (msg := self.next_message()) is not None:
            out.append(msg)
        return out

    # --- internals ----------------------------------------------------------------------------

    def _fill_frame(self, view: memoryview) -> memoryview:
        header = self._header
        need = (HEADER_BYTES if header is None else HEADER_BYTES + header.body_len) - len(self._buf)
        self._buf += view[:need]
        rest = view[need:]
        if len(self._buf) == HEADER_BYTES and header is None:
            header = self._header = self._parse_header(self._buf)
        if header is not None and len(self._buf) == HEADER_BYTES + header.body_len:
            self._finish_body(header)
        return rest

    def _parse_header(self, raw: bytearray) -> FrameHeader:
        magic, h = unpack_header(raw)
        if magic != MAGIC:
            raise BadMagic(f"bad frame magic {bytes(magic)!r}")
        if not header_crc_ok(raw):
            raise BadChecksum("frame header CRC mismatch")
        if h.version != self.version and h.type not in VERSION_FREE_TYPES:
            raise VersionMismatch(f"frame of wire version {h.version}, this side speaks {self.version}")
        cls = MESSAGE_TYPES.get(h.type)
        if cls is None:
            raise UnknownMessageType(f"unknown message type {h.type}")
        if h.flags:
            raise BadFlags(f"reserved flag bits set: {h.flags:#06x}")
        if h.body_len > self.max_body_bytes:
            raise FrameTooLarge(f"{cls.__name__} body of {h.body_len} bytes, limit {self.max_body_bytes}")
        if h.payload_len > self.max_payload_bytes:
            raise FrameTooLarge(f"payload of {h.payload_len} bytes, limit {self.max_payload_bytes}")
        if h.payload_len and cls.PAYLOAD_FIELD is None:
            raise MalformedMessage(f"{cls.__name__} carries no payload, header says {h.payload_len}")
        if h.stream_id and cls.STREAM_FIELD is None:
            raise MalformedMessage(f"{cls.__name__} has no stream id, header says {h.stream_id}")
        return h

    def _finish_body(self, h: FrameHeader) -> None:
        body = memoryview(self._buf)[HEADER_BYTES:]
        try:
            if zlib.crc32(body) != h.body_crc:
                raise BadChecksum("frame body CRC mismatch")
            cls = MESSAGE_TYPES[h.type]
            reader = BodyReader(body)
            kwargs = {name: codec.read(reader) for name, codec in _body_fields(cls)}
            if not reader.at_end():
                raise MalformedMessage(f"{cls.__name__} body has {len(body) - reader.pos} trailing bytes")
        finally:
            body.release()
        self._buf = bytearray()
        self._header = None
        if cls.STREAM_FIELD is not None:
            kwargs[cls.STREAM_FIELD] = h.stream_id
        if cls.PAYLOAD_FIELD is None:
            self._emit(cls, kwargs)
        else:
            self._pending = (cls, kwargs)
            self._payload = bytearray()
            self._payload_len = h.payload_len
            if h.payload_len == 0:
                self._complete_payload()

    def _fill_payload(self, view: memoryview) -> memoryview:
        assert self._payload is not None
        n = min(self._payload_len - len(self._payload), len(view))
        self._payload += view[:n]
        if len(self._payload) == self._payload_len:
            self._complete_payload()
        return view[n:]

    def _complete_payload(self) -> None:
        assert self._payload is not None and self._pending is not None
        (cls, kwargs), payload = self._pending, self._payload
        self._pending, self._payload = None, None
        kwargs[cls.PAYLOAD_FIELD or ""] = memoryview(payload).toreadonly()
        self._emit(cls, kwargs)

    def _emit(self, cls: type[WireMessage], kwargs: dict[str, Any]) -> None:
        self._ready.append(cls.from_wire(kwargs))
