"""Engine adapters: the contract (``base``) and its implementations, loaded by name.

``load_engine("torch_ref", ...)`` or ``load_engine("hf", ...)``: implementations import lazily so
that a missing optional dependency (transformers) fails only when chosen. A new adapter is one row
in ``ENGINES`` (name -> "module:Class"); its keyword arguments go to the class unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any

from engines_adapter.base import (
    EngineAdapter,
    EngineError,
    InvalidBlocks,
    InvalidRequest,
    InvalidTokens,
    KVBlocks,
    KVLayout,
    LayoutMismatch,
    PoolExhausted,
    SamplingParams,
    StepOutput,
    UnknownRequest,
)
from pddlink.errors import ConfigError

ENGINES: dict[str, str] = {
    "torch_ref": "engines_adapter.torch_ref.engine:TorchRefEngine",
    "hf": "engines_adapter.hf:HFEngine",
}


def load_engine(name: str, **kwargs: Any) -> EngineAdapter:
    """Build the engine registered under ``name`` with ``kwargs`` (see the class for its options)."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ConfigError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    engine = cls(**kwargs)
    if not isinstance(engine, EngineAdapter):
        raise ConfigError(f"{target} is not an EngineAdapter")
    return engine


__all__ = [
    "ENGINES",
    "EngineAdapter",
    "EngineError",
    "InvalidBlocks",
    "InvalidRequest",
    "InvalidTokens",
    "KVBlocks",
    "KVLayout",
    "LayoutMismatch",
    "PoolExhausted",
    "SamplingParams",
    "StepOutput",
    "UnknownRequest",
    "load_engine",
]
