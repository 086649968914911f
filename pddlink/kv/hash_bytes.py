"""A block hash as bytes: one byte order on every channel (wire frames, DRC events and snapshots,
the engine link, the hash chain itself).

Block hashes are 128-bit ints (``pddlink.kv.hashing``); as bytes they are always 16 bytes
big-endian, xxhash's canonical digest order, so a hash's bytes are the digest that made it.
"""

from __future__ import annotations

from typing import Final, Literal

HASH_BYTES: Final = 16
HASH_BYTE_ORDER: Final[Literal["big"]] = "big"


def hash_to_bytes(h: int) -> bytes:
    return h.to_bytes(HASH_BYTES, HASH_BYTE_ORDER)


def hash_from_bytes(data: bytes | memoryview) -> int:
    return int.from_bytes(data, HASH_BYTE_ORDER)
