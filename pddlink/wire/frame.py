"""The fixed frame header, and the base every wire message derives from.

Every frame is ``header (32 bytes) | body (body_len) | payload (payload_len)``::

    offset size field
     0     4    magic        b"PDLK"
     4     1    version      wire version (WIRE_VERSION)
     5     1    type         MessageType
     6     2    flags        reserved, must be 0
     8     8    stream_id    transfer id for transfer messages, else 0 (lets a transport demux
                             without decoding the body)
    16     4    body_len     bytes of the encoded message fields
    20     4    payload_len  bytes of opaque payload (chunk data, snapshots); 0 for most types
    24     4    body_crc     CRC-32 of the body
    28     4    header_crc   CRC-32 of bytes 0..27

The header CRC is checked before anything is allocated, so a corrupted length never makes the
decoder wait for or reserve bytes that will not come. Payload bytes are not covered by a frame CRC:
the messages that carry payload protect it with their own checksum (a chunk's xxh3-64), so a
corrupted payload is re-requested instead of killing the connection. All integers little-endian.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

from pddlink.wire.fields import WireStruct

MAGIC = b"PDLK"
# 2: block hashes big-endian (pddlink.kv.hash_bytes); 3: the sidecar gRPC's outcomes are enums with a
# reason field (pddlink.serving.stream_pb). One version for the sidecar protocols: frames, gRPC, records.
WIRE_VERSION = 3
HEADER = struct.Struct("<4sBBHQIIII")
HEADER_BYTES = HEADER.size
_HEADER_CRC_SPAN = HEADER_BYTES - 4
assert HEADER_BYTES == 32


class MessageType(IntEnum):
    """Frame type codes. Stable: never renumber, never reuse."""

    HELLO = 1
    HELLO_ACCEPT = 2
    HELLO_REFUSE = 3
    PING = 4
    PONG = 5
    ERROR = 6
    TRANSFER_BEGIN = 16
    CHUNK = 17
    ACK = 18
    RESUME = 19
    TRANSFER_END = 20
    ABORT = 21
    HANDOFF = 32
    INDEX_EVENTS = 48
    INDEX_SNAPSHOT_REQUEST = 49
    INDEX_SNAPSHOT = 50
    RESERVE = 64
    RESERVE_ANSWER = 65
    RELEASE = 66
    RDMA_SETUP = 80
    RDMA_READY = 81
    RDMA_DECLINE = 82
    RDMA_CREDIT = 83


# Hello and its answers keep this layout in every wire version, so two versions can still refuse
# each other with a clear reason instead of a framing error.
VERSION_FREE_TYPES = frozenset({MessageType.HELLO, MessageType.HELLO_ACCEPT, MessageType.HELLO_REFUSE})


@dataclass(frozen=True, slots=True)
class FrameHeader:
    version: int
    type: int
    flags: int
    stream_id: int
    body_len: int
    payload_len: int
    body_crc: int

    def pack(self) -> bytes:
        head = HEADER.pack(
            MAGIC,
            self.version,
            self.type,
            self.flags,
            self.stream_id,
            self.body_len,
            self.payload_len,
            self.body_crc,
            0,
        )[:_HEADER_CRC_SPAN]
        return head + zlib.crc32(head).to_bytes(4, "little")


def header_crc_ok(raw: bytes | bytearray | memoryview) -> bool:
    """Whether the 32 header bytes carry a valid header CRC."""
    return zlib.crc32(raw[:_HEADER_CRC_SPAN]) == int.from_bytes(raw[_HEADER_CRC_SPAN:HEADER_BYTES], "little")


def unpack_header(raw: bytes | bytearray | memoryview) -> tuple[bytes, FrameHeader]:
    """Split 32 header bytes into (magic, header) without validating them."""
    magic, version, mtype, flags, stream_id, body_len, payload_len, body_crc, _ = HEADER.unpack(
        raw[:HEADER_BYTES]
    )
    return magic, FrameHeader(version, mtype, flags, stream_id, body_len, payload_len, body_crc)


class WireMessage(WireStruct):
    """Base of every message. Subclasses are frozen slotted dataclasses that declare:

    - ``WIRE_TYPE``: the header type code;
    - ``WIRE_FIELDS``: the body, as (field, codec) pairs in wire order;
    - ``STREAM_FIELD``: the field carried in the header's stream id instead of the body (or None);
    - ``PAYLOAD_FIELD``: a bytes-like field sent as the frame payload, never copied (or None).
    """

    __slots__ = ()
    WIRE_TYPE: ClassVar[MessageType]
    STREAM_FIELD: ClassVar[str | None] = None
    PAYLOAD_FIELD: ClassVar[str | None] = None

    @property
    def stream_id(self) -> int:
        return 0 if self.STREAM_FIELD is None else int(getattr(self, self.STREAM_FIELD))


MESSAGE_TYPES: dict[int, type[WireMessage]] = {}


def register(cls: type[Any]) -> type[Any]:
    """Class decorator: make a message class decodable by its ``WIRE_TYPE``."""
    mtype = cls.WIRE_TYPE
    if mtype in MESSAGE_TYPES:
        raise TypeError(f"message type {mtype!r} registered twice")
    MESSAGE_TYPES[int(mtype)] = cls
    return cls
