"""Compact snapshot of a prefix index: how a mirror resyncs and how `pddlink drc` reads a saved cache.

Layout (version 1), all integers little-endian unless noted::

    magic "PDRC" | version u8 | flags u8 (0) | block_size u32 | epoch u64 | seq u64 | count u64
    | root 16 bytes (the hasher's chain root, big-endian; 0 when unknown) | deltas_len u64
    | zstd(parent deltas: count x u32) | hashes: count x 16 bytes big-endian

Blocks are listed parents first; block ``i``'s parent is block ``i - delta`` (``delta == 0``: the
root). Along a chain the delta is 1, so the deltas compress to almost nothing and a block costs
about 16 bytes. The snapshot is the index at ``(epoch, seq)``: a mirror that loads it then applies
events with larger ``seq``. Recency and pins are not included. Pure: bytes in, bytes out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from operator import itemgetter

import numpy as np
import zstandard

from pddlink.drc.index import PrefixIndex
from pddlink.errors import InvalidInput
from pddlink.kv.hash_bytes import HASH_BYTES, hash_from_bytes, hash_to_bytes

MAGIC = b"PDRC"
VERSION = 1
_HEADER = struct.Struct("<4sBBIQQQ16sQ")
_HASH = HASH_BYTES
_ZSTD_LEVEL = 3
_MAX_BLOCKS = 1 << 32


class SnapshotError(InvalidInput):
    """Bytes that are not a well-formed DRC snapshot."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    epoch: int
    seq: int
    block_size: int  # 0: not recorded
    root: int  # the chain root of the hasher that made the hashes; 0: not recorded
    hashes: tuple[int, ...]
    parents: tuple[int, ...]  # position of each block's parent in ``hashes``; -1: the root

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.parents):
            raise SnapshotError("hashes and parents differ in length")

    def to_index(self, capacity_blocks: int | None = None) -> PrefixIndex:
        """An index holding these blocks (no recency, no pins), continuing at this epoch and seq."""
        blocks = (
            (h, None if p < 0 else self.hashes[p]) for h, p in zip(self.hashes, self.parents, strict=True)
        )
        return PrefixIndex.from_blocks(
            blocks, capacity_blocks=capacity_blocks, epoch=self.epoch, seq=self.seq
        )


def parent_positions(index: PrefixIndex) -> tuple[list[int], np.ndarray]:
    """The cached hashes, parents first, and each one's parent position (-1: the root)."""
    hashes, parents = index.hashes_and_parents()
    n = len(hashes)
    # The per-block loops run in C (map, zip, fromiter), not in Python bytecode.
    position: dict[int | None, int] = dict(zip(hashes, range(n), strict=True))
    position[None] = -1
    return hashes, np.fromiter(map(position.__getitem__, parents), dtype=np.int64, count=n)


def encode_snapshot(index: PrefixIndex, *, block_size: int = 0, root: int = 0) -> bytes:
    """The index's blocks at its current ``(epoch, seq)``."""
    hashes, parent_at = parent_positions(index)
    n = len(hashes)
    deltas = np.where(parent_at < 0, 0, np.arange(n, dtype=np.int64) - parent_at).astype("<u4")
    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(deltas.tobytes())
    hash_bytes = b"".join(map(hash_to_bytes, hashes))
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        0,
        block_size,
        index.epoch,
        index.seq,
        len(hashes),
        hash_to_bytes(root),
        len(packed),
    )
    return b"".join([head, packed, hash_bytes])


def decode_snapshot(data: bytes) -> Snapshot:
    """Parses :func:`encode_snapshot`'s output; raises :class:`SnapshotError` on anything else."""
    if len(data) < _HEADER.size:
        raise SnapshotError(f"snapshot too short: {len(data)} bytes")
    magic, version, flags, block_size, epoch, seq, count, root, deltas_len = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or flags != 0:
        raise SnapshotError(f"not a DRC snapshot v{VERSION} (magic {magic!r}, version {version})")
    if count >= _MAX_BLOCKS or len(data) != _HEADER.size + deltas_len + count * _HASH:
        raise SnapshotError(f"snapshot length {len(data)} does not match {count} blocks")
    start = _HEADER.size
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            data[start : start + deltas_len], max_output_size=4 * count
        )
    except zstandard.ZstdError as exc:
        raise SnapshotError(f"parent deltas do not decompress: {exc}") from None
    if len(raw) != 4 * count:
        raise SnapshotError("parent deltas have the wrong length")
    deltas = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    positions = np.arange(count, dtype=np.int64)
    if np.any(deltas > positions):
        raise SnapshotError("a parent comes after its child")
    parents = np.where(deltas == 0, -1, positions - deltas)
    body = memoryview(data)[start + deltas_len :]
    hashes = tuple(map(hash_from_bytes, map(itemgetter(0), struct.iter_unpack("16s", body))))
    if len(set(hashes)) != count:
        raise SnapshotError("a block hash appears twice")
    return Snapshot(epoch, seq, block_size, hash_from_bytes(root), hashes, tuple(parents.tolist()))
