"""DRC change events: what a :class:`~pddlink.drc.index.PrefixIndex` publishes so mirrors can follow.

Every change of the index is exactly one event, numbered ``seq = 1, 2, 3, ...`` within an ``epoch``.
The epoch names one life of the index (one MainDecode process): it must grow on every restart (the
sidecar uses its start time in ns), so a mirror can tell a new life from a delayed event of an old one.

- ``BlocksStored(parent, hashes)``: a chain of blocks was added under ``parent`` (``None``: the root);
  ``hashes[0]``'s parent is ``parent`` and each later hash's parent is the one before it.
- ``BlocksRemoved(hashes)``: blocks were evicted, leaves first (children before their parents).
- ``IndexCleared()``: everything was dropped.

Events have a compact binary form (``encode_event`` / ``decode_event``) for the WAN: a fixed header
(kind, epoch, seq, count, has-parent) and 16-byte big-endian hashes. Pure: no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from pddlink.errors import InvalidInput
from pddlink.kv.hash_bytes import HASH_BYTES, hash_from_bytes, hash_to_bytes

_HASH_BYTES = HASH_BYTES
_MAX_HASH = 1 << (8 * _HASH_BYTES)
_HEADER = struct.Struct("<BBQQI")  # kind, has_parent, epoch, seq, count


class EventDecodeError(InvalidInput):
    """Bytes that are not a well-formed DRC event."""


class EventKind(IntEnum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3


def _check_header(epoch: int, seq: int) -> None:
    if not 0 <= epoch < 2**64:
        raise InvalidInput(f"epoch must be a u64, got {epoch}")
    if not 1 <= seq < 2**64:
        raise InvalidInput(f"seq must be in [1, 2**64), got {seq}")


def _check_hashes(hashes: tuple[int, ...]) -> None:
    for h in hashes:
        if not 0 <= h < _MAX_HASH:
            raise InvalidInput("block hashes must be 128-bit unsigned ints")


@dataclass(frozen=True, slots=True)
class BlocksStored:
    epoch: int
    seq: int
    parent: int | None
    hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_header(self.epoch, self.seq)
        if not self.hashes:
            raise InvalidInput("BlocksStored needs at least one hash")
        _check_hashes(self.hashes if self.parent is None else (self.parent, *self.hashes))


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    epoch: int
    seq: int
    hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_header(self.epoch, self.seq)
        if not self.hashes:
            raise InvalidInput("BlocksRemoved needs at least one hash")
        _check_hashes(self.hashes)


@dataclass(frozen=True, slots=True)
class IndexCleared:
    epoch: int
    seq: int

    def __post_init__(self) -> None:
        _check_header(self.epoch, self.seq)


Event = BlocksStored | BlocksRemoved | IndexCleared


def encode_event(event: Event) -> bytes:
    """The event's binary form (see the module docstring)."""
    hashes: tuple[int, ...] = ()
    parent: int | None = None
    if isinstance(event, BlocksStored):
        kind, hashes, parent = EventKind.STORED, event.hashes, event.parent
    elif isinstance(event, BlocksRemoved):
        kind, hashes = EventKind.REMOVED, event.hashes
    else:
        kind = EventKind.CLEARED
    head = _HEADER.pack(kind, parent is not None, event.epoch, event.seq, len(hashes))
    body = [] if parent is None else [hash_to_bytes(parent)]
    body.extend(map(hash_to_bytes, hashes))
    return head + b"".join(body)


def decode_event(data: bytes) -> Event:
    """Parses :func:`encode_event`'s output; raises :class:`EventDecodeError` on anything else."""
    if len(data) < _HEADER.size:
        raise EventDecodeError(f"event too short: {len(data)} bytes")
    kind, has_parent, epoch, seq, count = _HEADER.unpack_from(data)
    if kind not in EventKind._value2member_map_ or has_parent > 1:
        raise EventDecodeError(f"bad event header (kind {kind}, has_parent {has_parent})")
    n = count + has_parent
    if len(data) != _HEADER.size + n * _HASH_BYTES:
        raise EventDecodeError(f"event length {len(data)} does not match {count} hashes")
    mv = memoryview(data)[_HEADER.size :]
    ints = [hash_from_bytes(mv[i : i + _HASH_BYTES]) for i in range(0, n * _HASH_BYTES, _HASH_BYTES)]
    try:
        if kind == EventKind.STORED:
            parent = ints[0] if has_parent else None
            return BlocksStored(epoch, seq, parent, tuple(ints[has_parent:]))
        if has_parent:
            raise EventDecodeError("only BlocksStored carries a parent")
        if kind == EventKind.REMOVED:
            return BlocksRemoved(epoch, seq, tuple(ints))
        if count:
            raise EventDecodeError("IndexCleared carries no hashes")
        return IndexCleared(epoch, seq)
    except EventDecodeError:
        raise
    except InvalidInput as exc:
        raise EventDecodeError(exc.message) from None
