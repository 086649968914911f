"""Shared pieces of the engine tests: small models, engine sets for both adapters, the PDD path.

``pdd_generate`` plays the three roles of the design on three engines: P prefills and exports KV,
RLD imports it and decodes a few tokens, MD imports the prompt KV (reusing its own cached prefix),
extends with RLD's token ids (optionally in two overlapping catch-up slices) and decodes the rest
in a batch with an unrelated request. ``generate_alone`` is the baseline: one engine, start to end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engines_adapter.base import EngineAdapter, KVBlocks, SamplingParams
from engines_adapter.torch_ref import ModelConfig, TorchRefEngine, resolve_preset
from engines_adapter.torch_ref.weights import random_state_dict

SEED = 7
BLOCK = 4  # small blocks: every case crosses many block boundaries


def small_config() -> ModelConfig:
    return resolve_preset("tiny", max_positions=1024)


def torch_engine(
    dtype: str = "float64", *, num_blocks: int = 2048, block_size: int = BLOCK
) -> TorchRefEngine:
    return TorchRefEngine(
        small_config(), dtype=dtype, seed=SEED, block_size=block_size, num_blocks=num_blocks
    )


def hf_model(dtype: str = "float64"):  # type: ignore[no-untyped-def]
    """A transformers LlamaForCausalLM with the same weights as ``torch_engine`` (stateless: shareable)."""
    from engines_adapter.hf import llama_from_state_dict

    cfg = small_config()
    return llama_from_state_dict(cfg, random_state_dict(cfg, SEED), dtype)


def hf_engine(model=None, *, num_blocks: int = 2048, block_size: int = BLOCK) -> EngineAdapter:  # type: ignore[no-untyped-def]
    from engines_adapter.hf import HFEngine

    return HFEngine(
        model if model is not None else hf_model(),
        model_id="hf-test-llama",
        block_size=block_size,
        num_blocks=num_blocks,
    )


@dataclass
class Roles:
    p: EngineAdapter
    rld: EngineAdapter
    md: EngineAdapter
    alone: EngineAdapter


def generate_alone(engine: EngineAdapter, rid: str, prompt: Sequence[int], sp: SamplingParams) -> list[int]:
    out = engine.prefill(rid, prompt, sp)
    while not out.finished:
        out = engine.decode([rid])[0]
    return engine.tokens(rid)


def kv_array(kb: KVBlocks) -> np.ndarray:
    """Exported KV as ``[layers, 2, kv_heads, tokens, head_dim]`` float64 (real tokens only)."""
    lay = kb.layout
    dt = {"float64": "<f8", "float32": "<f4"}[lay.dtype]
    arr = np.frombuffer(bytes(kb.data), dtype=dt).reshape(
        kb.num_blocks, lay.num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim
    )
    arr = arr.transpose(1, 2, 3, 0, 4, 5).reshape(lay.num_layers, 2, lay.num_kv_heads, -1, lay.head_dim)
    return arr[:, :, :, : kb.num_tokens].astype(np.float64)


@dataclass
class PddResult:
    tokens: list[int]
    md_kv_after_extend: np.ndarray  # MD's KV of prompt + RLD's tokens, recomputed by extend
    rld_tokens: list[int]


def pdd_generate(
    roles: Roles,
    rid: str,
    prompt: Sequence[int],
    sp: SamplingParams,
    handoff_tokens: int,
    *,
    catch_up_at: int | None = None,
) -> PddResult:
    """P -> RLD (decodes until it holds ``handoff_tokens`` generated tokens) -> MD (extend, decode rest)."""
    p, rld, md = roles.p, roles.rld, roles.md
    t0 = p.prefill(rid, prompt, sp)
    assert not t0.finished
    whole = p.export_kv(rid)
    md_cached = md.cached_prefix_tokens(prompt)
    md_cached = min(md_cached, (len(prompt) // p.layout.block_size) * p.layout.block_size)
    suffix = p.export_kv(rid, first_block=md_cached // p.layout.block_size)
    p.release(rid)

    rld.import_kv(rid, prompt, [whole], sp)
    held = [t0.token_id]
    out = rld.extend(rid, held) if handoff_tokens > 1 else None
    while len(held) < handoff_tokens:
        assert out is not None and not out.finished
        held.append(out.token_id)
        if len(held) < handoff_tokens:
            out = rld.decode([rid])[0]
    rld_tokens = rld.tokens(rid)
    rld.release(rid)

    md.import_kv(rid, prompt, [suffix], sp, reuse_prefix_tokens=md_cached)
    if catch_up_at is not None:  # two slices; the second starts with MD's pending token
        first = md.extend(rid, held[:catch_up_at])
        assert first.token_id == held[catch_up_at], "MD's token after slice 1 differs from RLD's"
        out = md.extend(rid, held[catch_up_at:])
    else:
        out = md.extend(rid, held)
    kv = kv_array(md.export_kv(rid))
    companion = f"{rid}-companion"
    md.prefill(
        companion,
        [(t * 7 + 3) % md.vocab_size for t in prompt[:5]] + [1, 2, 3],
        SamplingParams(max_tokens=1000),
    )
    while not out.finished:
        out = next(o for o in md.decode([companion, rid]) if o.request_id == rid)
    tokens = md.tokens(rid)
    md.release(rid)
    md.release(companion, cache_prefix=False)
    return PddResult(tokens, kv, rld_tokens)
