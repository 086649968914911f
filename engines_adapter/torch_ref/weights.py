"""Weights of the reference decoder, by Llama checkpoint name: seeded random or from safetensors.

Names follow the Hugging Face Llama layout (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``), with q/k projections in the
"rotate half" RoPE convention that HF checkpoints use, so a real Llama-format checkpoint loads
as is and the same state dict loads into ``transformers.LlamaForCausalLM``.

Random weights are a pure function of (config, seed): drawn in float32 on the CPU in a fixed name
order, then cast, so every dtype and device starts from the same values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engines_adapter.torch_ref.presets import ModelConfig
from pddlink.errors import ConfigError

StateDict = dict[str, torch.Tensor]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * hd)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_state_dict(config: ModelConfig, seed: int) -> StateDict:
    """Deterministic weights: unit-variance embeddings, 1/sqrt(fan_in) projections, norms near 1.

    Scaled so logits spread over a few units: greedy choices are clear and top-k/top-p matter.
    """
    gen = torch.Generator().manual_seed(seed)
    out: StateDict = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return out


def load_safetensors(path: str | Path, config: ModelConfig) -> StateDict:
    """Load a Llama-format checkpoint (one ``.safetensors`` file or a directory of shards)."""
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise ConfigError(f"no safetensors weights at {p}")
    state: StateDict = {}
    for f in files:
        state.update(load_file(str(f)))
    check_state_dict(state, config)
    return state


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory from its Llama ``config.json``."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p.with_name("config.json")
    if not cfg_file.is_file():
        raise ConfigError(f"no config.json next to the weights at {p}; give a preset instead")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {cfg_file}: {exc}") from None
    name = raw.get("_name_or_path") or (p if p.is_dir() else p.parent).name
    return ModelConfig.from_hf_config(raw, name=str(name))


def save_safetensors(state: StateDict, path: str | Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def check_state_dict(state: StateDict, config: ModelConfig) -> None:
    """Refuse a checkpoint whose names or shapes do not match the config (extra names are ignored)."""
    shapes = expected_shapes(config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = [n for n in shapes if n not in state]
    if missing:
        raise ConfigError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[0]}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"checkpoint {name} has shape {tuple(state[name].shape)}, config needs {shape}")
