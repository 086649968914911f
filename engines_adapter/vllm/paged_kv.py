"""Copies whole KV blocks between vLLM's paged cache and a flat byte buffer (a region slot).

The buffer is block-major: block 0 of every layer (in vLLM's layer order), then block 1, ... so the
suffix from any block on is one contiguous byte range (what travels to MD). Whole blocks only: the
interior of a block is the attention kernel's own (vLLM's CPU kernels pack it per ISA), so the
connector moves the full blocks below the prompt's last token and MD recomputes the tail. Tried:
cutting a partial block to its token rows assuming ``[kv_heads, 2, block_size, head_dim]`` changed
4 of 50 greedy outputs on CPU.
Inside one layer's block the bytes are vLLM's own (declared ``[kv_heads, block_size, 2 * head_dim]`` on
CPU), so a producer and a consumer built with the same model, dtype and block size agree without
any conversion; the ``KVLayoutSpec`` that travels with each transfer checks that.

Works for any per-layer tensor whose block dimension is the one sized ``num_blocks`` (dim 0 on CPU,
dim 1 on GPU flash layouts ``[2, num_blocks, ...]``); device tensors go through host memory.

The copy is one pass per layer, straight between the paged cache and the buffer (the shared-memory
slot), with no intermediate tensor: on CPU, where each layer is a contiguous ``[num_blocks, ...]``
tensor, a layer is a ``[num_blocks, block_bytes]`` byte matrix and ``np.take(..., out=)`` gathers the
block rows into the slot's strided ``[n, block_bytes]`` column band (``scatter``: one fancy-index
assignment the other way). numpy, not torch, on purpose: it copies on the calling thread, while
torch's ``index_select``/``index_copy_`` split the copy over vLLM's OpenMP threads, whose barrier
waits for the slowest of them (on a loaded machine 20-100 ms for 4 MB, against 0.4 ms alone).
Other layouts and device tensors take the general torch path (``index_select`` then a copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pddlink.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class LayerSpec:
    name: str
    block_dim: int
    block_bytes: int


def _byte_rows(t: torch.Tensor, num_blocks: int) -> npt.NDArray[np.uint8] | None:
    """``t`` as a writable ``[num_blocks, block_bytes]`` numpy byte matrix sharing its memory, when
    it is a contiguous CPU tensor with the blocks in dim 0; else None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] != num_blocks:
        return None
    rows: npt.NDArray[np.uint8] = t.view(num_blocks, -1).view(torch.uint8).numpy()
    return rows


class PagedKV:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.tensors = list(kv_caches.values())
        self.num_blocks = num_blocks
        self.layers: list[LayerSpec] = []
        for name, t in kv_caches.items():
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise InvalidInput(f"layer {name}: no dimension of {tuple(t.shape)} has {num_blocks} blocks")
            per_block = t.numel() // num_blocks * t.element_size()
            self.layers.append(LayerSpec(name, dims[0], per_block))
        self.bytes_per_block = sum(s.block_bytes for s in self.layers)
        first = self.tensors[0]
        self.dtype, self.device = first.dtype, first.device
        # one byte matrix per layer when every layer has one (CPU); else the torch path
        rows = [
            _byte_rows(t, num_blocks) if spec.block_dim == 0 else None
            for spec, t in zip(self.layers, self.tensors, strict=True)
        ]
        self.rows: list[npt.NDArray[np.uint8]] | None = [r for r in rows if r is not None]
        if len(self.rows) != len(rows):
            self.rows = None
        self.path = "numpy" if self.rows is not None else "torch"

    def _flat(self, buf: memoryview, n: int) -> npt.NDArray[np.uint8]:
        if buf.nbytes != n * self.bytes_per_block:
            raise InvalidInput(
                f"{n} blocks need {n * self.bytes_per_block} bytes, the buffer has {buf.nbytes}"
            )
        return np.frombuffer(buf, dtype=np.uint8).reshape(n, self.bytes_per_block)

    def _index(self, block_ids: Sequence[int]) -> npt.NDArray[np.intp]:
        idx = np.asarray(block_ids, dtype=np.intp)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise InvalidInput(f"block ids outside vLLM's {self.num_blocks} blocks: {list(block_ids)[:8]}...")
        return idx

    def gather(self, block_ids: Sequence[int], out: memoryview) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out`` (block-major)."""
        n = len(block_ids)
        if n == 0:
            return
        dst = self._flat(out, n)
        idx = self._index(block_ids)
        off = 0
        if self.rows is not None:
            for spec, rows in zip(self.layers, self.rows, strict=True):
                # indices checked above; "clip" lets numpy write into the strided band unbuffered
                np.take(rows, idx, axis=0, out=dst[:, off : off + spec.block_bytes], mode="clip")
                off += spec.block_bytes
            return
        dst_t = torch.from_numpy(dst)
        index = torch.from_numpy(idx).to(torch.long).to(self.device)
        for spec, t in zip(self.layers, self.tensors, strict=True):
            part = t.index_select(spec.block_dim, index).movedim(spec.block_dim, 0).contiguous()
            dst_t[:, off : off + spec.block_bytes].copy_(part.view(n, -1).view(torch.uint8).cpu())
            off += spec.block_bytes

    def scatter(self, block_ids: Sequence[int], src: memoryview) -> None:
        """Write ``src`` (block-major, as ``gather`` makes it) into blocks ``block_ids``."""
        n = len(block_ids)
        if n == 0:
            return
        flat = self._flat(src, n)
        idx = self._index(block_ids)
        off = 0
        if self.rows is not None:
            for spec, rows in zip(self.layers, self.rows, strict=True):
                rows[idx] = flat[:, off : off + spec.block_bytes]
                off += spec.block_bytes
            return
        flat_t = torch.from_numpy(flat)
        index = torch.from_numpy(idx).to(torch.long).to(self.device)
        for spec, t in zip(self.layers, self.tensors, strict=True):
            shape = list(t.shape)
            del shape[spec.block_dim]
            part = flat_t[:, off : off + spec.block_bytes].contiguous().view(t.dtype).view(n, *shape)
            t.index_copy_(spec.block_dim, index, part.to(t.device).movedim(0, spec.block_dim))
            off += spec.block_bytes
