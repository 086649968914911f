"""A KV transfer's payload under a codec: what the sender puts on the wire, what the receiver gets back.

``TransferBegin.codec`` names the codec of the whole payload. ``CodecId.RAW``: the payload is the
KV bytes themselves. ``CodecId.PLANES_ZSTD``: the payload is a sequence of ``pddlink.kv.codec``
frames, one per ``FRAME_BYTES`` of KV, concatenated (a frame may straddle the transfer's chunks;
the receiver decodes once the transfer is whole and verified). Each frame is self-describing and
checksummed, so ``decode_payload`` walks them, checks every frame's dtype against the layout's and
the decoded total against what the receiver expects, and raises ``CorruptFrame`` /
``UnsupportedFrame`` rather than return other bytes than the sender encoded. Pure: no I/O; the
thread pool is the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pddlink.errors import InvalidInput
from pddlink.kv.codec import (
    DTYPE_BY_WIRE,
    FRAME_MAGIC,
    HEADER,
    CodecId,
    CorruptFrame,
    KVDtype,
    ParallelCodec,
    UnsupportedFrame,
    body_bytes,
    decode_chunk,
    encode_chunk,
    frame_info,
    iter_chunks,
)

FRAME_BYTES: Final = 1 << 20  # KV bytes per codec frame
# HEADER fields: magic, version, codec, dtype, flags, reserved, raw, packed
_CODEC, _DTYPE, _RAW_BYTES, _PACKED_BYTES = 2, 3, 6, 7


def encode_payload(
    data: memoryview | bytes | bytearray,
    dtype: KVDtype | str,
    codec: CodecId,
    pool: ParallelCodec | None = None,
) -> memoryview:
    """The wire payload of ``data`` under ``codec`` (RAW: ``data`` itself, no copy)."""
    view = memoryview(data).cast("B")
    if codec is CodecId.RAW:
        return view
    kind = KVDtype.parse(dtype)
    if not kind.plane_codable:
        raise InvalidInput(f"codec {codec.name} does not apply to {kind.name} KV")
    chunks = list(iter_chunks(view, FRAME_BYTES, kind.itemsize))
    frames = pool.encode_all(chunks, kind) if pool is not None else [encode_chunk(c, kind) for c in chunks]
    return memoryview(b"".join(frames))


def split_frames(payload: memoryview) -> list[memoryview]:
    """The codec frames of a concatenated payload (lengths from each header; contents unchecked)."""
    frames: list[memoryview] = []
    pos, end = 0, len(payload)
    while pos < end:
        if end - pos < HEADER.size:
            raise CorruptFrame(f"payload ends {end - pos} bytes into a frame header")
        fields = HEADER.unpack_from(payload, pos)
        if fields[0] != FRAME_MAGIC:
            raise CorruptFrame(f"bad frame magic {bytes(fields[0])!r} at payload byte {pos}")
        codec, kind = CodecId._value2member_map_.get(fields[_CODEC]), DTYPE_BY_WIRE.get(fields[_DTYPE])
        if not isinstance(codec, CodecId) or kind is None:
            raise UnsupportedFrame(f"frame with codec id {fields[_CODEC]}, dtype id {fields[_DTYPE]}")
        body = body_bytes(codec, kind, fields[_RAW_BYTES], fields[_PACKED_BYTES])
        if body < 0:
            raise CorruptFrame(f"a {codec.name} frame header with lengths no {kind.name} frame has")
        if pos + HEADER.size + body > end:
            raise CorruptFrame("payload ends inside a frame body")
        frames.append(payload[pos : pos + HEADER.size + body])
        pos += HEADER.size + body
    return frames


def decode_payload(
    chunks: Sequence[memoryview | bytes],
    codec: CodecId,
    dtype: KVDtype | str,
    *,
    expected_bytes: int | None = None,
    pool: ParallelCodec | None = None,
) -> memoryview:
    """The KV bytes of a received payload. ``expected_bytes``: the KV size the layout implies."""
    kind = KVDtype.parse(dtype)
    if codec is CodecId.RAW:
        data = memoryview(chunks[0]).cast("B") if len(chunks) == 1 else memoryview(b"".join(chunks))
    else:
        payload = memoryview(chunks[0]).cast("B") if len(chunks) == 1 else memoryview(b"".join(chunks))
        frames = split_frames(payload)
        for frame in frames:
            _, frame_dtype, _ = frame_info(frame)
            if frame_dtype is not kind:
                raise CorruptFrame(f"a {frame_dtype.name} frame in a transfer of {kind.name} KV")
        parts = pool.decode_all(frames) if pool is not None else [decode_chunk(f) for f in frames]
        data = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
    if expected_bytes is not None and len(data) != expected_bytes:
        raise CorruptFrame(f"payload decodes to {len(data)} KV bytes, the transfer names {expected_bytes}")
    return data
