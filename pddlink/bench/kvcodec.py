"""``--codec kv`` for the link bench: KV bytes go through ``pddlink.kv.codec`` on both ends.

The sender compresses every transfer anew (chunks of ``FRAME_BYTES`` on a thread pool, zstd
releases the GIL) and sends the concatenated frames as the transfer's payload; the receiver splits
the payload back into frames by their headers and decodes them on its own pool. Goodput is counted
in raw KV bytes delivered, so the codec's ratio and its CPU cost both show in the figure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pddlink.errors import InvalidInput
from pddlink.kv.codec import HEADER, CodecId, ParallelCodec, iter_chunks

FRAME_BYTES = 1 << 20
DTYPE = "bfloat16"
_CODEC, _RAW_BYTES, _PACKED_BYTES = 2, 6, 7  # fields of HEADER: magic, version, codec, dtype, ...


def frame_lengths(data: memoryview) -> list[int]:
    """Lengths of the concatenated codec frames in ``data`` (headers only; decode validates)."""
    lengths, pos = [], 0
    while pos < len(data):
        if len(data) - pos < HEADER.size:
            raise InvalidInput("truncated codec frame header")
        fields = HEADER.unpack_from(data, pos)
        codec, raw_bytes, packed_bytes = fields[_CODEC], fields[_RAW_BYTES], fields[_PACKED_BYTES]
        body = raw_bytes if codec == CodecId.RAW else packed_bytes + raw_bytes // 2
        lengths.append(HEADER.size + body)
        pos += HEADER.size + body
    return lengths


async def compress(codec: ParallelCodec, kv: memoryview) -> bytes:
    loop = asyncio.get_running_loop()
    frames = await loop.run_in_executor(None, codec.encode_all, list(iter_chunks(kv, FRAME_BYTES, 2)), DTYPE)
    return b"".join(frames)


async def decompress(codec: ParallelCodec, chunks: Sequence[memoryview]) -> int:
    """Decode a received payload; returns the raw KV bytes it held."""
    data = memoryview(b"".join(chunks))
    frames, pos = [], 0
    for length in frame_lengths(data):
        frames.append(data[pos : pos + length])
        pos += length
    loop = asyncio.get_running_loop()
    decoded = await loop.run_in_executor(None, codec.decode_all, frames)
    return sum(len(d) for d in decoded)
