"""The index tensors of one forward pass over the paged pool (built by the engine, read by the model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where a forward pass reads and writes: ``B`` sequences, ``n`` new tokens each.

    ``positions[b, j]`` is the absolute position of new token ``j``; ``slot_blocks``/``slot_offsets``
    (``B * n``, row-major) name the pool slot that receives its K/V; ``block_tables`` (``[B, max_blocks]``,
    padded with any valid block id) list each sequence's blocks covering every position up to its
    last new token.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    block_tables: torch.Tensor
    no_past: bool = False  # every sequence starts at position 0 (a cold prefill)
