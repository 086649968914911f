"""Copies between a paged KV cache and a region slot, byte for byte against the cache itself: the
numpy path (contiguous CPU layers, vLLM's CPU layout), the torch path (other layouts), round trips
through ``scatter``, and refused input. No vLLM needed: the caches are plain tensors shaped as vLLM's."""

from __future__ import annotations

import mmap
import random

import pytest
import torch

from engines_adapter.vllm.paged_kv import PagedKV
from pddlink.errors import InvalidInput

NB = 97  # blocks in the cache


def _cache(dtype: torch.dtype, *, block_first: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NB, 2, 32, 16) if block_first else (2, NB, 32, 16)
    return {f"layer.{i}": torch.randn(shape, generator=g).to(dtype) for i in range(3)}


def _expected(kv: dict[str, torch.Tensor], ids: list[int], block_dim: int) -> bytes:
    """Block-major bytes, built block by block from the cache's own tensors."""
    return b"".join(
        t.select(block_dim, b).contiguous().view(torch.uint8).numpy().tobytes()
        for b in ids
        for t in kv.values()
    )


def _slot(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))  # a shared mapping, as the region slot is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_first", [True, False])
def test_gather_is_the_cache_byte_for_byte(dtype: torch.dtype, block_first: bool) -> None:
    kv = _cache(dtype, block_first=block_first)
    paged = PagedKV(kv, NB)
    assert paged.path == ("numpy" if block_first else "torch")
    ids = random.Random(1).sample(range(NB), 40)
    out = _slot(len(ids) * paged.bytes_per_block)
    paged.gather(ids, out)
    assert bytes(out) == _expected(kv, ids, 0 if block_first else 1)


def test_non_contiguous_layers_take_the_torch_path_and_stay_exact() -> None:
    kv = {k: v.transpose(2, 3) for k, v in _cache(torch.float32).items()}  # block dim 0, strided
    paged = PagedKV(kv, NB)
    assert paged.path == "torch"
    ids = [5, 0, NB - 1, 17]
    out = _slot(len(ids) * paged.bytes_per_block)
    paged.gather(ids, out)
    assert bytes(out) == _expected(kv, ids, 0)


@pytest.mark.parametrize("block_first", [True, False])
def test_scatter_writes_exactly_the_named_blocks(block_first: bool) -> None:
    src_kv, dst_kv = (
        _cache(torch.bfloat16, block_first=block_first, seed=1),
        _cache(torch.bfloat16, block_first=block_first, seed=2),
    )
    src, dst = PagedKV(src_kv, NB), PagedKV(dst_kv, NB)
    before = {k: v.clone() for k, v in dst_kv.items()}
    from_ids, to_ids = [3, 4, 50, 96], [90, 1, 2, 60]
    slot = _slot(len(from_ids) * src.bytes_per_block)
    src.gather(from_ids, slot)
    dst.scatter(to_ids, slot)
    back = _slot(len(to_ids) * dst.bytes_per_block)
    dst.gather(to_ids, back)
    assert bytes(back) == bytes(slot) == _expected(src_kv, from_ids, 0 if block_first else 1)
    bd = 0 if block_first else 1
    untouched = [b for b in range(NB) if b not in to_ids]
    for name, t in dst_kv.items():
        keep = torch.tensor(untouched)
        assert torch.equal(t.index_select(bd, keep), before[name].index_select(bd, keep))


def test_refuses_wrong_sizes_and_block_ids() -> None:
    paged = PagedKV(_cache(torch.float32), NB)
    with pytest.raises(InvalidInput, match="need"):
        paged.gather([1, 2], _slot(paged.bytes_per_block))
    with pytest.raises(InvalidInput, match="outside"):
        paged.gather([NB], _slot(paged.bytes_per_block))
    with pytest.raises(InvalidInput, match="outside"):
        paged.scatter([-1], _slot(paged.bytes_per_block))
    with pytest.raises(InvalidInput, match="no dimension"):
        PagedKV({"l": torch.zeros(4, 4)}, NB)
    paged.gather([], memoryview(b""))  # nothing to copy: no error
