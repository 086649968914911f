"""Configuration, the transfer manifest, and the integrity functions both sides share.

``chunk_checksum`` is xxh3-64 of one chunk's bytes; ``transfer_digest`` is xxh3-128 over the chunk
checksums (8 bytes little-endian each) in index order, so the receiver can check the whole transfer
without re-reading its data and whatever order the chunks arrived in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from pddlink.errors import ConfigError, InvalidInput
from pddlink.kv.codec import CodecId
from pddlink.wire.transfer_messages import KVLayoutSpec

MIB = 2**20


def chunk_checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def transfer_digest(checksums: Iterable[int]) -> int:
    return xxhash.xxh3_128_intdigest(b"".join(c.to_bytes(8, "little") for c in checksums))


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Knobs of one side. ``window_bytes`` bounds sent-but-unacknowledged bytes (at least one chunk
    is always allowed); ``resume_retry_s`` is how long a resuming sender waits for the receiver's
    ``Resume`` before asking again; ``begin_timeout_s`` bounds how long a receiver keeps chunks that arrived
    (over another striped connection) before their ``TransferBegin``."""

    chunk_bytes: int = 1 * MIB
    window_bytes: int = 32 * MIB
    max_selective_acks: int = 64
    max_chunk_retries: int = 8
    begin_timeout_s: float = 5.0
    resume_retry_s: float = 2.0
    max_early_bytes: int = 64 * MIB
    max_transfer_bytes: int = 2**40
    assemble: bool = True  # receiver copies chunks into one buffer (else the consumer keeps payloads)

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_bytes < 2**32:
            raise ConfigError(f"TransferConfig.chunk_bytes must be in [1, 2**32), got {self.chunk_bytes}")
        if self.window_bytes < self.chunk_bytes:
            raise ConfigError("TransferConfig.window_bytes must be at least chunk_bytes")
        for name in ("max_selective_acks", "max_chunk_retries", "max_early_bytes", "max_transfer_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"TransferConfig.{name} must be >= 0")
        for name in ("begin_timeout_s", "resume_retry_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"TransferConfig.{name} must be positive, got {value}")


@dataclass(frozen=True, slots=True)
class TransferManifest:
    """What a transfer carries, besides its bytes: the request, its KV layout and block identities."""

    request_id: str
    layout: KVLayoutSpec
    block_hashes: tuple[int, ...]
    num_tokens: int
    first_block: int = 0
    codec: CodecId = CodecId.RAW

    def __post_init__(self) -> None:
        if not isinstance(self.block_hashes, tuple):
            if not isinstance(self.block_hashes, Sequence):
                raise InvalidInput("TransferManifest.block_hashes must be a sequence of ints")
            object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        if self.num_tokens < 0 or self.first_block < 0:
            raise InvalidInput("TransferManifest counts must be >= 0")
        object.__setattr__(self, "codec", CodecId(self.codec))
