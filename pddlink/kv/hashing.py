"""Chained block hashing: the identity of a KV block across processes, machines and datacenters.

``h_i = H(scheme, namespace, h_{i-1}, tokens[i*B:(i+1)*B])`` with ``h_{-1} = 0``: a block's hash
names its whole prefix, so two prompts share block ``i`` only when they share every token before it.
The namespace folds in the model id and an optional tenant salt (tenants never share blocks unless
they share the salt). The scheme id is versioned and travels in the wire handshake: two sides that
hash differently refuse to talk instead of silently missing every block.

Only full blocks are hashed; a trailing partial block has no identity. Hashes are 128-bit ints
(xxh3-128), independent of ``PYTHONHASHSEED``. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import xxhash

from pddlink.errors import ErrorCode, InvalidInput

_U128 = 16


class HashScheme(IntEnum):
    """Versioned hash schemes. A new scheme gets a new value; old values are never reused."""

    XXH3_128_U32LE_V1 = 1  # xxh3-128 over parent(16 bytes LE) + token ids as uint32 LE


SUPPORTED_SCHEMES = frozenset(HashScheme)


class HashSchemeMismatch(InvalidInput):
    code = ErrorCode.HASH_SCHEME_MISMATCH


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes token ids into chained block hashes for one (scheme, model, tenant, block size)."""

    model_id: str
    block_size: int
    tenant_salt: str = ""
    scheme: HashScheme = HashScheme.XXH3_128_U32LE_V1

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidInput(f"block_size must be positive, got {self.block_size}")
        if self.scheme not in SUPPORTED_SCHEMES:
            raise HashSchemeMismatch(f"unknown hash scheme {int(self.scheme)}")

    @property
    def root(self) -> int:
        """The chain's seed: the namespace digest, so different models/tenants never collide."""
        ns = f"pddlink/{int(self.scheme)}/{self.model_id}/{self.tenant_salt}/{self.block_size}"
        return xxhash.xxh3_128_intdigest(ns.encode())

    def hash_blocks(self, token_ids: Sequence[int] | np.ndarray, parent: int | None = None) -> list[int]:
        """Hashes of every full block of ``token_ids``, chained from ``parent`` (default: the root)."""
        arr = np.asarray(token_ids)
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise InvalidInput("token ids must be in [0, 2**32)")
        data = arr.astype("<u4", copy=False).tobytes()
        step = self.block_size * 4
        n_full = len(data) // step
        h = self.root if parent is None else parent
        digest = xxhash.xxh3_128_intdigest
        out: list[int] = []
        append = out.append
        for i in range(n_full):
            h = digest(h.to_bytes(_U128, "little") + data[i * step : (i + 1) * step])
            append(h)
        return out

    def full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size
