"""Where a forward pass reads a batch's context from: the paged pool, or a decode workspace.

``PoolGather`` gathers every sequence's blocks from the pool on every pass: right for prefill and
extend, whose batches never repeat. A decode batch usually repeats for many steps (the same
requests, one token longer each time), and regathering its whole context each step moves the
context bytes three times per layer. ``DecodeWorkspace`` gathers once into contiguous per-layer
buffers ``[kv_heads, B, capacity, head_dim]``, then each step appends the new token's K/V (to the
pool, which stays the source of truth, and to the workspace) and attends over the workspace in
place. It is rebuilt when the batch changes: other members, a member whose KV moved on outside
decode (an extend), or no room left. The engine builds one only for a batch seen twice in a row,
so a batch that rotates every step (more requests than the batch size) keeps gathering instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engines_adapter.torch_ref.batch import PagedBatch
from engines_adapter.torch_ref.kv_pool import KVPool

HEADROOM_TOKENS = 128  # decode steps a workspace can take before it must grow


class KVAccess(Protocol):
    """The context of one forward pass: store new K/V, read ``[kv_heads, B, context_len, hd]``."""

    context_len: int

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PoolGather:
    """Gather the batch's blocks from the pool, layer by layer, on every pass."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch
        self.table = batch.block_tables.reshape(-1)
        self.bsz = batch.block_tables.shape[0]
        self.context_len = batch.block_tables.shape[1] * pool.layout.block_size

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.pool.write_tokens(layer, self.batch.slot_blocks, self.batch.slot_offsets, keys, values)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.gather(layer, self.table, self.bsz)


class DecodeWorkspace:
    """One decode batch's K/V, contiguous and kept across steps (see the module docstring)."""

    def __init__(
        self, pool: KVPool, members: Sequence[object], kv_tokens: Sequence[int], block_tables: torch.Tensor
    ) -> None:
        lay = pool.layout
        self.members = tuple(members)
        self.lengths = list(kv_tokens)
        bsz = len(self.members)
        self.capacity = max(self.lengths) + 1 + HEADROOM_TOKENS
        shape = (lay.num_layers, lay.num_kv_heads, bsz, self.capacity, lay.head_dim)
        self.keys = pool.data.new_empty(shape)
        self.values = pool.data.new_empty(shape)
        table = block_tables.reshape(-1)
        for li in range(lay.num_layers):
            k, v = pool.gather(li, table, bsz)
            n = min(k.shape[2], self.capacity)
            self.keys[li, :, :, :n] = k[:, :, :n]
            self.values[li, :, :, :n] = v[:, :, :n]
        # Slots not yet written must hold finite values: masked scores are score + (-inf).
        self.keys[:, :, :, n:] = 0
        self.values[:, :, :, n:] = 0

    @staticmethod
    def nbytes_for(pool: KVPool, batch_size: int, max_kv_tokens: int) -> int:
        return batch_size * (max_kv_tokens + 1 + HEADROOM_TOKENS) * pool.layout.bytes_per_token

    def fits(self, members: Sequence[object], kv_tokens: Sequence[int]) -> bool:
        """True when this step continues exactly the batch the workspace holds."""
        return (
            len(members) == len(self.members)
            and all(a is b for a, b in zip(members, self.members, strict=True))
            and list(kv_tokens) == self.lengths
            and max(self.lengths) + 1 <= self.capacity
        )

    def step(self, pool: KVPool, batch: PagedBatch) -> _WorkspaceStep:
        return _WorkspaceStep(self, pool, batch)

    def advance(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]


class _WorkspaceStep:
    """One decode step over a workspace: new K/V go to the pool and the workspace; reads are views."""

    def __init__(self, ws: DecodeWorkspace, pool: KVPool, batch: PagedBatch) -> None:
        self.ws, self.pool, self.batch = ws, pool, batch
        self.rows = torch.arange(len(ws.members), device=ws.keys.device)
        self.positions = batch.positions.reshape(-1)
        self.context_len = max(ws.lengths) + 1

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.pool.write_tokens(layer, self.batch.slot_blocks, self.batch.slot_offsets, keys, values)
        self.ws.keys[layer][:, self.rows, self.positions] = keys.transpose(0, 1)
        self.ws.values[layer][:, self.rows, self.positions] = values.transpose(0, 1)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.context_len
        return self.ws.keys[layer, :, :, :n], self.ws.values[layer, :, :, :n]
