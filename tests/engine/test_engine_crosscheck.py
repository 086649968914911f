"""The reference engine against an independent implementation, and weights from safetensors.

Same weights copied into ``transformers``' LlamaForCausalLM: logits at every position match to
1e-5 in float32. A Llama-format safetensors file written here from a random model loads into the
engine (and into transformers) and gives the same logits as the in-memory weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _engine_testkit import SEED, small_config, torch_engine

from engines_adapter.base import SamplingParams
from engines_adapter.torch_ref import TorchRefEngine
from engines_adapter.torch_ref.weights import random_state_dict, save_safetensors
from pddlink.errors import ConfigError

transformers = pytest.importorskip("transformers")
from engines_adapter.hf import llama_config, llama_from_state_dict  # noqa: E402


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2048) for _ in range(n)]


def _hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([prompt])).logits[0]
    return out


@pytest.mark.parametrize("length", [1, 17, 130])
def test_logits_match_transformers_llama_float32(length: int) -> None:
    cfg = small_config()
    engine = torch_engine("float32")
    model = llama_from_state_dict(cfg, random_state_dict(cfg, SEED), "float32")
    prompt = _prompt(length, seed=length)
    ours = engine.prompt_logits(prompt)
    theirs = _hf_logits(model, prompt)
    assert ours.shape == theirs.shape == (length, cfg.vocab_size)
    assert theirs.abs().max() > 1.0  # logits of substance, not near-zero noise
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_paged_steps_match_transformers_full_recompute() -> None:
    """Prefill + decode steps through the pool give the logits of a full forward of the whole sequence."""
    cfg = small_config()
    engine = torch_engine("float32")
    model = llama_from_state_dict(cfg, random_state_dict(cfg, SEED), "float32")
    prompt = _prompt(23, seed=5)
    engine.prefill("r", prompt, SamplingParams(max_tokens=10))
    for _ in range(6):
        engine.decode(["r"])
    seq = engine.tokens("r")
    expected_next = _hf_logits(model, seq[:-1]).argmax(-1)[len(prompt) - 1 :].tolist()
    assert seq[len(prompt) :] == expected_next


def test_safetensors_checkpoint_loads_in_engine_and_transformers(tmp_path: Path) -> None:
    cfg = small_config()
    state = random_state_dict(cfg, 1234)
    path = tmp_path / "model.safetensors"
    save_safetensors(state, path)
    from_file = TorchRefEngine(cfg, dtype="float32", weights_path=path)
    from_memory = TorchRefEngine(cfg, dtype="float32", state_dict=random_state_dict(cfg, 1234))
    other_seed = torch_engine("float32")
    prompt = _prompt(40)
    logits = from_file.prompt_logits(prompt)
    assert torch.equal(logits, from_memory.prompt_logits(prompt))
    assert not torch.allclose(logits, other_seed.prompt_logits(prompt))
    assert from_file.layout.model_id.endswith("file:model.safetensors")

    hf = transformers.LlamaForCausalLM(llama_config(cfg))
    from safetensors.torch import load_file

    hf.load_state_dict(load_file(str(path)))
    torch.testing.assert_close(logits, _hf_logits(hf.eval(), prompt), rtol=0, atol=1e-5)


def test_safetensors_with_wrong_shapes_is_refused(tmp_path: Path) -> None:
    cfg = small_config()
    state = random_state_dict(cfg, 1)
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:-1]
    save_safetensors(state, tmp_path / "bad.safetensors")
    with pytest.raises(ConfigError, match="up_proj"):
        TorchRefEngine(cfg, weights_path=tmp_path / "bad.safetensors")
    del state["model.layers.0.mlp.up_proj.weight"]
    save_safetensors(state, tmp_path / "missing.safetensors")
    with pytest.raises(ConfigError, match="lacks"):
        TorchRefEngine(cfg, weights_path=tmp_path / "missing.safetensors")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_every_dtype_generates_and_stays_close_to_float64(dtype: str) -> None:
    ref = torch_engine("float64").prompt_logits(_prompt(30))
    got = torch_engine(dtype).prompt_logits(_prompt(30))
    assert got.dtype == getattr(torch, dtype)
    tol = {"bfloat16": 0.5, "float32": 1e-4, "float64": 0.0}[dtype]
    assert (got.double() - ref).abs().max().item() <= tol


def test_checkpoint_directory_with_llama3_rope_loads_by_its_config_json(tmp_path: Path) -> None:
    """A ``save_pretrained`` directory (config.json + model.safetensors), as real checkpoints ship."""
    from engines_adapter.torch_ref.model import _rope_tables
    from engines_adapter.torch_ref.presets import Llama3RopeScaling, resolve_preset

    cfg = resolve_preset(
        "tiny",
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_positions=2048,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 64),
    )
    model = llama_from_state_dict(cfg, random_state_dict(cfg, 99), "float32")
    model.save_pretrained(tmp_path)
    engine = TorchRefEngine(None, weights_path=tmp_path, dtype="float32")
    assert engine.config.rope_scaling == cfg.rope_scaling and engine.config.tie_word_embeddings
    prompt = _prompt(64, seed=3)
    theirs_logits = _hf_logits(model, prompt)
    # Tied unit-variance embeddings make logits ~100 large: float32 agreement is relative to that scale.
    scale = float(theirs_logits.abs().max())
    torch.testing.assert_close(engine.prompt_logits(prompt), theirs_logits, rtol=0, atol=2e-6 * scale)
    # The scaled frequencies themselves agree with transformers' llama3 rotary embedding.
    cos, _ = _rope_tables(engine.config, torch.float64, torch.device("cpu"))
    ours = torch.acos(cos[1, : cfg.head_dim // 2].clamp(-1, 1))  # position 1: angle == inv_freq
    theirs = model.model.rotary_emb.inv_freq.double()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_unsupported_checkpoint_configs_are_refused(tmp_path: Path) -> None:
    import json

    base = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 64,
    }
    for extra, match in (
        ({"model_type": "gpt2"}, "not llama"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "yarn"),
        ({"attention_bias": True}, "biases"),
        ({"head_dim": 4}, "head_dim"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(ConfigError, match=match):
            TorchRefEngine(None, weights_path=tmp_path)
    with pytest.raises(ConfigError, match="needs weights_path"):
        TorchRefEngine(None)
