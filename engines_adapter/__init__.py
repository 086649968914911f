"""Engine adapters: the contract (``base``) and its implementations, loaded by name.

``load_engine("torch_ref", ...)`` or ``load_engine("hf", ...)``: implementations import lazily so
that a missing optional dependency (transformers) fails only when chosen.
"""

from engines_adapter.base import (
    EngineAdapter,
    EngineError,
    InvalidBlocks,
    InvalidTokens,
    KVBlocks,
    KVLayout,
    LayoutMismatch,
    PoolExhausted,
    SamplingParams,
    StepOutput,
    UnknownRequest,
)

__all__ = [
    "EngineAdapter",
    "EngineError",
    "InvalidBlocks",
    "InvalidTokens",
    "KVBlocks",
    "KVLayout",
    "LayoutMismatch",
    "PoolExhausted",
    "SamplingParams",
    "StepOutput",
    "UnknownRequest",
]
