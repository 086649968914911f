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
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (as in Llama-3.1/3.2 ``config.json``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def __post_init__(self) -> None:
        if (
            self.factor <= 0
            or self.original_max_positions <= 0
            or not 0 < self.low_freq_factor < self.high_freq_factor
        ):
            raise ConfigError("rope scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor")


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
    rope_scaling: Llama3RopeScaling | None = None

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
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if self.rope_scaling is not None:
            out["rope_scaling"] = {
                f: getattr(self.rope_scaling, f) for f in self.rope_scaling.__dataclass_fields__
            }
        return out

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], name: str = "checkpoint") -> ModelConfig:
        """The config of a Llama-format checkpoint from its ``config.json`` contents (transformers 4 or 5)."""
        if d.get("model_type", "llama") != "llama":
            raise ConfigError(f"checkpoint model_type {d.get('model_type')!r} is not llama")
        rope = dict(d.get("rope_parameters") or {})
        rope.update(d.get("rope_scaling") or {})
        theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ConfigError(f"rope type {kind!r} is not supported (default and llama3 are)")
        scaling = None
        if kind == "llama3":
            scaling = Llama3RopeScaling(
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        try:
            config = cls(
                name=name,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=d["num_attention_heads"],
                num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                intermediate_size=d["intermediate_size"],
                max_positions=d["max_position_embeddings"],
                rope_theta=float(theta),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
            )
        except KeyError as exc:
            raise ConfigError(f"checkpoint config.json lacks {exc.args[0]!r}") from None
        if d.get("head_dim") not in (None, config.head_dim):
            raise ConfigError(
                f"head_dim {d['head_dim']} differs from hidden_size / num_heads = {config.head_dim}"
            )
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError("attention or MLP biases are not supported")
        return config


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
