"""The paged KV pool: one preallocated tensor of blocks, a block allocator and a prefix cache.

Storage is a single preallocated tensor, laid out for attention (kv-head-major, see ``KVPool``);
export and import convert to the contract's block-major byte layout.

Block lifecycle::

    free --allocate--> referenced (refcount >= 1) --decref to 0--> free            (never hashed)
                            |  register(hash)                 \\--> cached (LRU)   (hashed)
                            v                                        | lookup -> referenced again
                       referenced + hashed                           | evict / allocate under pressure -> free

A full block is registered under its chained block hash (``pddlink.kv.hashing.BlockHasher``) as
soon as its KV is computed, so concurrent requests that share a prefix share its blocks. A cached
block with no reference sits in an LRU list; ``allocate`` takes free blocks first and then evicts
the least recently used cached blocks, and remembers the evicted hashes (``drain_evicted``) so the
owner can tell the decode-side prefix index. Pure bookkeeping plus tensor copies; no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from engines_adapter.base import InvalidBlocks, KVLayout, PoolExhausted

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# A same-size integer view, for dtypes numpy cannot hold (bfloat16): bytes travel bit-exact.
_BITS_VIEW: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16}


class BlockAllocator:
    """Reference counts, the free list and the hash -> block prefix cache of a pool of blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise InvalidBlocks(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references
        self._evicted: list[int] = []

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def available(self, pinned: Iterable[int] = ()) -> int:
        """Blocks ``allocate`` could hand out once ``pinned`` (about to be referenced) are held."""
        taken = sum(1 for b in set(pinned) if b in self._lru)
        return len(self._free) + len(self._lru) - taken

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free) + len(self._lru):
            raise PoolExhausted(f"KV pool needs {n} blocks, {len(self._free) + len(self._lru)} can be freed")
        out: list[int] = []
        for _ in range(n):
            if not self._free:
                victim, _ = self._lru.popitem(last=False)
                self._evicted.append(self._unregister(victim))
                self._free.append(victim)
            block = self._free.pop()
            self._refs[block] = 1
            out.append(block)
        return out

    # -- references -------------------------------------------------------------------------
    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                self._lru.pop(b, None)
            self._refs[b] += 1

    def decref(self, blocks: Iterable[int], *, uncache: frozenset[int] = frozenset()) -> None:
        """Drop one reference each; an unreferenced block is cached if hashed (and not in ``uncache``)."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of and b not in uncache:
                self._lru[b] = None
            else:
                if b in self._hash_of:
                    self._unregister(b)
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # -- prefix cache -----------------------------------------------------------------------
    def register(self, block: int, block_hash: int) -> bool:
        """Cache a full, referenced block under its chained hash; False if the hash is already cached."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def lookup_chain(self, block_hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of a hash chain."""
        out: list[int] = []
        for h in block_hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def evict(self, block_hashes: Iterable[int]) -> int:
        """Drop hashes from the cache; unreferenced blocks are freed now, referenced ones on release."""
        n = 0
        for h in block_hashes:
            b = self._block_of.get(h)
            if b is None:
                continue
            self._unregister(b)
            if b in self._lru:
                del self._lru[b]
                self._free.append(b)
            n += 1
        return n

    def drain_evicted(self) -> list[int]:
        """Hashes evicted under memory pressure since the last call (for the prefix index)."""
        out, self._evicted = self._evicted, []
        return out

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def snapshot(self) -> tuple[object, ...]:
        """A comparable picture of the whole bookkeeping (tests assert bad input leaves it alone)."""
        return (
            tuple(sorted(self._free)),
            tuple(self._refs),
            tuple(sorted(self._block_of.items())),
            tuple(self._lru),
        )

    def _unregister(self, block: int) -> int:
        h = self._hash_of.pop(block)
        del self._block_of[h]
        return h


class KVPool:
    """The pool tensor plus its allocator, for one ``KVLayout`` on one device.

    Internally the tensor is ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``: a
    layer's keys for one kv head are then one contiguous run per block, so gathering a batch's blocks
    yields ``[kv_heads, B, tokens, head_dim]`` that attention reads without another copy. Export and
    import permute to and from the contract's byte layout (block-major), off the hot path.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if layout.dtype not in TORCH_DTYPES:
            raise InvalidBlocks(
                f"pool dtype {layout.dtype!r} is not supported; use one of {sorted(TORCH_DTYPES)}"
            )
        self.layout = layout
        self.allocator = BlockAllocator(num_blocks)
        self.data = torch.zeros(
            (layout.num_layers, 2, layout.num_kv_heads, num_blocks, layout.block_size, layout.head_dim),
            dtype=TORCH_DTYPES[layout.dtype],
            device=device,
        )
        self._gather_buf = self.data.new_empty((2, 0))

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def write_tokens(
        self,
        layer: int,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Store ``keys``/``values`` ``[N, kv_heads, head_dim]`` of N tokens at their slots."""
        self.data[layer, 0][:, slot_blocks, slot_offsets] = keys.transpose(0, 1).to(self.data.dtype)
        self.data[layer, 1][:, slot_blocks, slot_offsets] = values.transpose(0, 1).to(self.data.dtype)

    def gather(self, layer: int, block_table: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, batch, blocks * block_size, head_dim]`` (contiguous) of a flat
        ``block_table`` listing ``batch`` equally long rows of block ids.

        The results are views of scratch buffers reused by the next call: use them before gathering again.
        """
        lay = self.layout
        shape = (lay.num_kv_heads, block_table.numel(), lay.block_size, lay.head_dim)
        k_out, v_out = self._scratch(shape)
        torch.index_select(self.data[layer, 0], 1, block_table, out=k_out)
        torch.index_select(self.data[layer, 1], 1, block_table, out=v_out)
        return k_out.view(lay.num_kv_heads, batch, -1, lay.head_dim), v_out.view(
            lay.num_kv_heads, batch, -1, lay.head_dim
        )

    def _scratch(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Two preallocated buffers of ``shape`` (grown geometrically): no allocation per decode step."""
        numel = math.prod(shape)
        if self._gather_buf.shape[1] < numel:
            self._gather_buf = self.data.new_empty((2, max(numel, 2 * self._gather_buf.shape[1])))
        return self._gather_buf[0, :numel].view(shape), self._gather_buf[1, :numel].view(shape)

    def read_blocks(self, blocks: Sequence[int], num_tokens: int) -> bytes:
        """Bytes of ``blocks`` in the export layout; slots past ``num_tokens`` are zeroed."""
        if not blocks:
            return b""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.data.device)
        out = self.data.index_select(3, idx).permute(3, 0, 1, 2, 4, 5).contiguous()
        tail = num_tokens - (len(blocks) - 1) * self.layout.block_size
        if tail < self.layout.block_size:
            out[-1, :, :, :, tail:] = 0
        return _tensor_bytes(out)

    def write_blocks(self, blocks: Sequence[int], payload: bytes | bytearray | memoryview) -> None:
        """Store blocks given in the export layout ``[n, layers, 2, kv_heads, block_size, head_dim]``."""
        if not blocks:
            return
        lay = self.layout
        shape = (len(blocks), lay.num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)
        bits = torch.frombuffer(bytearray(payload), dtype=_BITS_VIEW[lay.itemsize])
        src = bits.view(self.data.dtype).view(shape).permute(1, 2, 3, 0, 4, 5).to(self.data.device)
        idx = torch.tensor(blocks, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(3, idx, src)

    def sequence_kv(self, blocks: Sequence[int], num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One sequence's KV per layer as ``[1, kv_heads, num_tokens, head_dim]`` (for HF caches)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.data.device)
        lay = self.layout
        flat = self.data.index_select(3, idx).view(lay.num_layers, 2, lay.num_kv_heads, -1, lay.head_dim)
        flat = flat[:, :, :, :num_tokens]
        return [(flat[li, 0].unsqueeze(0), flat[li, 1].unsqueeze(0)) for li in range(lay.num_layers)]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian bytes of a tensor, bit-exact for every dtype (via a same-size int view)."""
    flat = t.detach().contiguous().view(_BITS_VIEW[t.element_size()]).cpu().numpy()
    return flat.astype(flat.dtype.newbyteorder("<"), copy=False).tobytes()
