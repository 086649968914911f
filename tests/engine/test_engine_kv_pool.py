"""KV bytes: the documented export layout, bit-exact round trips in every dtype, zeroed padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _engine_testkit import BLOCK, torch_engine

from engines_adapter.base import KVLayout, PoolExhausted, SamplingParams
from engines_adapter.torch_ref.kv_pool import BlockAllocator, KVPool

SP = SamplingParams(max_tokens=4)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_export_import_round_trip_is_bit_exact(dtype: str) -> None:
    src, dst = torch_engine(dtype), torch_engine(dtype)
    prompt = list(range(3, 3 + 5 * BLOCK + 3))
    first = src.prefill("r", prompt, SP)
    kb = src.export_kv("r")
    assert kb.num_blocks == 6 and kb.num_tokens == len(prompt)
    assert len(kb.data) == 6 * kb.layout.bytes_per_block
    dst.import_kv("r", prompt, [kb], SP)
    assert bytes(dst.export_kv("r").data) == bytes(kb.data)
    assert dst.extend("r", [first.token_id]).token_id == src.decode(["r"])[0].token_id


def test_export_layout_is_block_major_and_matches_the_model() -> None:
    eng = torch_engine("float64")
    prompt = list(range(40, 40 + 2 * BLOCK + 1))
    eng.prefill("r", prompt, SP)
    kb = eng.export_kv("r")
    lay = eng.layout
    arr = np.frombuffer(bytes(kb.data), dtype="<f8").reshape(
        kb.num_blocks, lay.num_layers, 2, lay.num_kv_heads, BLOCK, lay.head_dim
    )
    # Block 1 alone equals the second block of the whole export.
    one = np.frombuffer(bytes(eng.export_kv("r", 1, 1).data), dtype="<f8").reshape(arr.shape[1:])
    assert np.array_equal(one, arr[1])
    # Layer 0 values of token t are W_v @ rmsnorm(embedding(t)): no attention before them.
    model = eng.model
    x = model.embed[torch.tensor(prompt)]
    h = torch.nn.functional.rms_norm(x, (x.shape[-1],), model.layers[0].attn_norm, eng.config.rms_norm_eps)
    hq = eng.config.num_heads * lay.head_dim
    v = (h @ model.layers[0].w_qkv.T)[:, hq + lay.num_kv_heads * lay.head_dim :]
    v = v.reshape(len(prompt), lay.num_kv_heads, lay.head_dim).numpy()
    got = arr[:, 0, 1].transpose(0, 2, 1, 3).reshape(-1, lay.num_kv_heads, lay.head_dim)
    np.testing.assert_allclose(got[: len(prompt)], v, atol=1e-12)
    assert not got[len(prompt) :].any()  # the partial last block is zero-padded


def test_padding_is_zero_even_in_recycled_blocks() -> None:
    eng = torch_engine(num_blocks=8)
    eng.prefill("a", list(range(1, 1 + 8 * BLOCK - 1)), SP)
    eng.release("a", cache_prefix=False)  # every block now holds stale KV
    eng.prefill("b", [7], SP)
    kb = eng.export_kv("b")
    per_token = kb.layout.bytes_per_token
    assert kb.num_tokens == 1 and len(kb.data) == BLOCK * per_token
    arr = np.frombuffer(bytes(kb.data), dtype="<f8").reshape(
        kb.layout.num_layers, 2, kb.layout.num_kv_heads, BLOCK, kb.layout.head_dim
    )
    assert arr[:, :, :, 0].any() and not arr[:, :, :, 1:].any()


def test_layout_describes_bytes_per_token() -> None:
    lay = torch_engine("bfloat16").layout
    assert lay.bytes_per_token == 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * 2
    assert KVLayout.from_dict(lay.to_dict()) == lay


def test_allocator_refuses_more_than_it_has_without_changing() -> None:
    alloc = BlockAllocator(4)
    got = alloc.allocate(3)
    snap = alloc.snapshot()
    with pytest.raises(PoolExhausted):
        alloc.allocate(2)
    assert alloc.snapshot() == snap
    alloc.decref(got)
    assert alloc.num_free == 4


def test_pool_gather_returns_each_sequence_in_position_order() -> None:
    lay = KVLayout("m", num_layers=1, num_kv_heads=2, head_dim=3, dtype="float32", block_size=2)
    pool = KVPool(lay, num_blocks=5)
    blocks = torch.tensor([3, 1, 4])
    offs = torch.tensor([0, 1, 0])
    keys = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3)
    pool.write_tokens(0, blocks, offs, keys, -keys)
    k, v = pool.gather(0, torch.tensor([3, 1]), batch=1)  # [kv_heads, 1, 4 tokens, head_dim]
    assert torch.equal(k[:, 0, 0], keys[0]) and torch.equal(k[:, 0, 3], keys[1])
    assert torch.equal(v[:, 0, 0], -keys[0])
