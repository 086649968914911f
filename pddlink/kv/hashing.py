"""Chained block hashing: the identity of a KV block across processes, machines and datacenters.

Definition (scheme 1, ``XXH3_128_U32LE_V1``), fixed: every side must compute exactly this.

- ``ns = "pddlink/{scheme}/{model_id}/{tenant_salt}/{block_size}"`` (UTF-8)
- ``d_{-1} = xxh3_128_digest(ns)``: the chain's root (16 bytes, xxhash's canonical big-endian digest)
- ``d_i = xxh3_128_digest(d_{i-1} || tokens[i*B:(i+1)*B] as uint32 little-endian)``
- the hash value of block ``i`` is ``int.from_bytes(d_i, "big")`` (equal to ``xxh3_128_intdigest``
  of the same input); a parent given as an int is fed back as its 16-byte big-endian form.

A block's hash names its whole prefix, so two prompts share block ``i`` only when they share every
token before it, and a set of hashes that is closed under "parent of" is a prefix tree (what
``pddlink.drc`` relies on). The namespace folds in the model id, the block size and an optional tenant
salt (tenants never share blocks unless they share the salt). The scheme id travels in the wire
handshake: two sides that hash differently refuse to talk instead of silently missing every block.

Only full blocks are hashed; a trailing partial block has no identity. Hashes are 128-bit ints,
independent of ``PYTHONHASHSEED``. The chain is kept in digest (bytes) form inside the loop and each
hash is turned into an int once, which is what makes a 64K-token prompt hash in a fraction of a ms.

Two implementations of the same chain: a list or tuple of ints goes through the optional C extension
``pddlink.kv._native_hash`` (libxxhash's XXH3_128bits; unboxing, chaining and int creation in one
loop, about 4x faster on a 64K-token prompt) when it was built at install time (``NATIVE``);
everything else, and every input where it is not built, takes the pure-Python path (pack the ids
with ``array``, chain with the ``xxhash`` package). Both give the same hashes and the same typed
errors (tests/kv/test_kv_native_hash.py). Pure: no I/O.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import cast

import numpy as np
import xxhash

from pddlink.errors import ErrorCode, InvalidInput
from pddlink.kv.hash_bytes import hash_to_bytes

_NativeChain = Callable[[list[int] | tuple[int, ...], int, bytes], list[int] | None]
_native_chain: _NativeChain | None
try:
    from pddlink.kv._native_hash import chain_u32 as _native_chain
except ImportError:  # not built (no compiler or no libxxhash headers at install): pure Python
    _native_chain = None

NATIVE: bool = _native_chain is not None
"""Whether lists and tuples of token ids are hashed by the C extension (else by pure Python)."""

_U128 = 16
_TOKEN_BYTES = 4
MAX_BLOCK_SIZE = 1 << 20  # tokens per block; engines page at 16-4096, the simulator at 2048
_RANGE_ERROR = "token ids must be ints in [0, 2**32)"


class HashScheme(IntEnum):
    """Versioned hash schemes. A new scheme gets a new value; old values are never reused."""

    XXH3_128_U32LE_V1 = 1  # see the module docstring for the exact definition


SUPPORTED_SCHEMES = frozenset(HashScheme)


class HashSchemeMismatch(InvalidInput):
    code = ErrorCode.HASH_SCHEME_MISMATCH


def token_buffer(token_ids: Sequence[int] | np.ndarray) -> memoryview:
    """Token ids as uint32 little-endian bytes (no copy when already so); refuses ids outside
    ``[0, 2**32)``."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind not in "iu":
            raise InvalidInput(f"token ids must be integers, got dtype {token_ids.dtype}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= 2**32):
            raise InvalidInput("token ids must be in [0, 2**32)")
        return np.ascontiguousarray(token_ids, dtype="<u4").data.cast("B")
    try:
        if isinstance(token_ids, list):  # C-speed conversion with range checks; fromlist is fastest
            packed = array("I")
            packed.fromlist(token_ids)
        else:
            packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidInput(f"{_RANGE_ERROR}: {exc}") from None
    if packed.itemsize != _TOKEN_BYTES:  # pragma: no cover - no mainstream platform
        return memoryview(np.asarray(token_ids, dtype="<u4").tobytes())
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return memoryview(packed).cast("B")


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes token ids into chained block hashes for one (scheme, model, tenant, block size)."""

    model_id: str
    block_size: int
    tenant_salt: str = ""
    scheme: HashScheme = HashScheme.XXH3_128_U32LE_V1

    def __post_init__(self) -> None:
        if not 0 < self.block_size <= MAX_BLOCK_SIZE:
            raise InvalidInput(f"block_size must be 1-{MAX_BLOCK_SIZE} tokens, got {self.block_size}")
        if self.scheme not in SUPPORTED_SCHEMES:
            raise HashSchemeMismatch(f"unknown hash scheme {int(self.scheme)}")

    @property
    def namespace(self) -> bytes:
        return f"pddlink/{int(self.scheme)}/{self.model_id}/{self.tenant_salt}/{self.block_size}".encode()

    @property
    def root(self) -> int:
        """The chain's seed: the namespace digest, so different models/tenants never collide."""
        return xxhash.xxh3_128_intdigest(self.namespace)

    def hash_blocks(self, token_ids: Sequence[int] | np.ndarray, parent: int | None = None) -> list[int]:
        """Hashes of every full block of ``token_ids``, chained from ``parent`` (default: the root)."""
        # exact lists and tuples only: C reads their storage directly, which a subclass's own
        # __getitem__ would not see
        exact = isinstance(token_ids, list | tuple) and type(token_ids) in (list, tuple)
        if _native_chain is not None and exact:
            parent_digest = self._parent_digest(parent)
            try:
                ids = cast("list[int] | tuple[int, ...]", token_ids)
                hashes = _native_chain(ids, self.block_size, parent_digest)
            except OverflowError as exc:
                raise InvalidInput(f"{_RANGE_ERROR}: {exc}") from None
            if hashes is not None:  # None: an item is not an int; the Python path converts or refuses
                return hashes
        return self.hash_block_bytes(token_buffer(token_ids), parent)

    def _parent_digest(self, parent: int | None) -> bytes:
        """The digest the chain starts from: the root's, or ``parent``'s 16-byte big-endian form."""
        if parent is None:
            return xxhash.xxh3_128_digest(self.namespace)
        if 0 <= parent < 2 ** (8 * _U128):
            return hash_to_bytes(parent)
        raise InvalidInput("parent hash must be a 128-bit unsigned int")

    def hash_block_bytes(self, data: bytes | memoryview, parent: int | None = None) -> list[int]:
        """As :meth:`hash_blocks`, for tokens already packed as uint32 little-endian bytes (always
        the pure-Python chain; ``hash_block_bytes(token_buffer(ids))`` is the reference path)."""
        if isinstance(data, memoryview) and data.format != "B":
            data = data.cast("B")
        if len(data) % _TOKEN_BYTES:
            raise InvalidInput(f"token bytes must be a multiple of {_TOKEN_BYTES}, got {len(data)}")
        d = self._parent_digest(parent)
        step = self.block_size * _TOKEN_BYTES
        end = len(data) - len(data) % step
        digest = xxhash.xxh3_128_digest
        chain: list[bytes] = []
        append = chain.append
        for off in range(0, end, step):
            d = digest(d + data[off : off + step])
            append(d)
        return list(map(int.from_bytes, chain))  # big-endian is int.from_bytes' default

    def full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size
