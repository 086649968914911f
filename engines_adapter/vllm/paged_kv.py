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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pddlink.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class LayerSpec:
    name: str
    block_dim: int
    block_bytes: int


class PagedKV:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.tensors = list(kv_caches.values())
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

    def _flat(self, buf: memoryview, n: int) -> torch.Tensor:
        if buf.nbytes != n * self.bytes_per_block:
            raise InvalidInput(
                f"{n} blocks need {n * self.bytes_per_block} bytes, the buffer has {buf.nbytes}"
            )
        return torch.frombuffer(buf, dtype=torch.uint8).view(n, self.bytes_per_block)

    def gather(self, block_ids: Sequence[int], out: memoryview) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out`` (block-major)."""
        n = len(block_ids)
        if n == 0:
            return
        dst = self._flat(out, n)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        off = 0
        for spec, t in zip(self.layers, self.tensors, strict=True):
            part = t.index_select(spec.block_dim, idx).movedim(spec.block_dim, 0).contiguous()
            dst[:, off : off + spec.block_bytes].copy_(part.view(n, -1).view(torch.uint8).cpu())
            off += spec.block_bytes

    def scatter(self, block_ids: Sequence[int], src: memoryview) -> None:
        """Write ``src`` (block-major, as ``gather`` makes it) into blocks ``block_ids``."""
        n = len(block_ids)
        if n == 0:
            return
        flat = self._flat(src, n)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        off = 0
        for spec, t in zip(self.layers, self.tensors, strict=True):
            shape = list(t.shape)
            del shape[spec.block_dim]
            part = flat[:, off : off + spec.block_bytes].contiguous().view(t.dtype).view(n, *shape)
            t.index_copy_(spec.block_dim, idx, part.to(t.device).movedim(0, spec.block_dim))
            off += spec.block_bytes
