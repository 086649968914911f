"""The torch reference engine: a Llama-style decoder over a paged KV pool (see ``engine``)."""

from engines_adapter.torch_ref.engine import TorchRefEngine
from engines_adapter.torch_ref.presets import PRESETS, ModelConfig, resolve_preset

__all__ = ["PRESETS", "ModelConfig", "TorchRefEngine", "resolve_preset"]
