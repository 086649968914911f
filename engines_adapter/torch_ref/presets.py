"""Model shapes of the reference engine, from ``tiny`` (fast on 2 CPU cores) up to Llama-3.2-1B.

A ``ModelConfig`` fixes everything that decides the weights' shapes and the numerics of a forward
pass; the KV layout follows from it plus the pool's block size and dtype. Presets are plain values;
``resolve_preset`` turns a name (or a config) into one and refuses unknown names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pddlink.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
        ):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model.{f} must be positive, got {getattr(self, f)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size {self.hidden_size} is not a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads {self.num_heads} is not a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ConfigError("model.head_dim must be even (rotary embedding)")
        if self.max_positions <= 0 or self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("model.max_positions, rope_theta and rms_norm_eps must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


PRESETS: dict[str, ModelConfig] = {
    # The demo's engine: ~0.8 M parameters; a decode step costs about a millisecond on one core.
    "tiny": ModelConfig(
        "tiny",
        vocab_size=2048,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
    ),
    # Big enough that matmuls, not Python, dominate on a CPU: the engine benchmark's default.
    "small": ModelConfig(
        "small",
        vocab_size=8192,
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
    ),
    "medium": ModelConfig(
        "medium",
        vocab_size=32000,
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
    ),
    # Llama-3.2-1B's shapes (load its safetensors with weights_path to run the real model).
    "llama-1b": ModelConfig(
        "llama-1b",
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        max_positions=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}


def resolve_preset(preset: str | ModelConfig, **overrides: Any) -> ModelConfig:
    """A preset by name (or a given config), with field overrides applied and validated."""
    if isinstance(preset, ModelConfig):
        base = preset
    else:
        try:
            base = PRESETS[preset]
        except KeyError:
            raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}") from None
    unknown = set(overrides) - set(ModelConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown model field(s): {', '.join(sorted(unknown))}")
    return replace(base, **overrides) if overrides else base
