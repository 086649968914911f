"""The engine contract over any ``transformers`` causal LM.

The adapter keeps every request's KV in its own paged pool (the same ``KVPool`` and lifecycle as
the reference engine, so prefix reuse, export/import and the byte layout are identical) and
converts to and from a ``transformers`` ``DynamicCache`` around each forward pass: the request's
blocks are gathered into a cache holding its past, the model runs on the new tokens, and the new
tokens' K/V are copied from the cache back into the pool.

Requests of a decode batch run one after another (no padding); this adapter is for exactness and
for models the reference engine does not implement, not for speed. Works with any decoder whose
cache layers expose ``keys``/``values`` of shape ``[batch, kv_heads, seq, head_dim]`` (Llama,
Mistral, Qwen2 and their relatives). Nothing is downloaded: pass a model object, or a local path.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from engines_adapter.base import KVLayout
from engines_adapter.torch_ref.kv_pool import TORCH_DTYPES
from engines_adapter.torch_ref.paged_engine import PagedEngine, SequenceState
from engines_adapter.torch_ref.presets import ModelConfig
from engines_adapter.torch_ref.weights import StateDict
from pddlink.errors import ConfigError, Unavailable

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # the optional extra is missing
        raise Unavailable("the hf engine needs transformers: pip install 'pddlink[hf]'") from exc
    return transformers


class HFEngine(PagedEngine):
    """``EngineAdapter`` over a ``transformers`` causal LM, with a paged KV store of its own."""

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        *,
        model_path: str | Path | None = None,
        model_id: str | None = None,
        block_size: int = 16,
        num_blocks: int = 4096,
        device: str = "cpu",
        chunk_tokens: int = 2048,
    ) -> None:
        tf = _transformers()
        if (model is None) == (model_path is None):
            raise ConfigError("give exactly one of model and model_path")
        if model is None:
            model = tf.AutoModelForCausalLM.from_pretrained(str(model_path), local_files_only=True)
        cast(torch.nn.Module, model).to(torch.device(device)).eval()  # moves in place
        cfg = model.config.get_text_config(decoder=True)
        dtype = str(model.dtype).removeprefix("torch.")
        if dtype not in TORCH_DTYPES:
            raise ConfigError(f"model dtype {dtype} is not supported")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if model_id is None:
            model_id = f"hf/{getattr(cfg, 'name_or_path', '') or type(model).__name__}"
        layout = KVLayout(model_id, cfg.num_hidden_layers, kv_heads, head_dim, dtype, block_size)
        super().__init__(
            layout=layout,
            vocab_size=cfg.vocab_size,
            max_positions=cfg.max_position_embeddings,
            num_blocks=num_blocks,
            device=torch.device(device),
            chunk_tokens=chunk_tokens,
        )
        self.model = model
        self._cache_config = model.config
        # transformers 5 renamed the forward argument ``past_key_values`` to ``cache``.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def _run(self, seqs: Sequence[SequenceState], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.cat([self._run_one(s, t) for s, t in zip(seqs, new_tokens, strict=True)])

    def _run_one(self, seq: SequenceState, new: Sequence[int]) -> torch.Tensor:
        tf = _transformers()
        past, n, bs = seq.kv_tokens, len(new), self.layout.block_size
        cache = tf.DynamicCache(
            ddp_cache_data=self._past_kv(seq) if past else None, config=self._cache_config
        )
        positions = torch.arange(past, past + n, device=self.device)
        out = self.model(
            input_ids=torch.tensor([list(new)], device=self.device),
            position_ids=positions.unsqueeze(0),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        table = torch.tensor(seq.blocks, dtype=torch.long, device=self.device)
        slot_blocks, slot_offsets = table[positions // bs], positions % bs
        for li, (keys, values) in enumerate(_cache_tensors(cache)):
            self.pool.write_tokens(
                li,
                slot_blocks,
                slot_offsets,
                keys[0, :, past:].transpose(0, 1),
                values[0, :, past:].transpose(0, 1),
            )
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def _past_kv(self, seq: SequenceState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The request's KV as ``[1, kv_heads, kv_tokens, head_dim]`` per layer, gathered from its blocks."""
        nb = -(-seq.kv_tokens // self.layout.block_size)
        return self.pool.sequence_kv(seq.blocks[:nb], seq.kv_tokens)


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a ``DynamicCache``, across transformers versions."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def llama_config(config: ModelConfig) -> LlamaConfig:
    """The ``transformers`` LlamaConfig with the same shapes and numerics as a reference preset."""
    tf = _transformers()
    config_cls: type[LlamaConfig] = tf.LlamaConfig
    kwargs: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "max_position_embeddings": config.max_positions,
        "rope_theta": config.rope_theta,  # transformers 5 folds it into rope_parameters
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }
    rs = config.rope_scaling
    if rs is not None:
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_positions,
        }
    return config_cls(**kwargs)


def llama_from_state_dict(config: ModelConfig, state: StateDict, dtype: str = "float32") -> PreTrainedModel:
    """A ``LlamaForCausalLM`` holding the given Llama-named weights (the independent cross-check)."""
    tf = _transformers()
    model: PreTrainedModel = tf.LlamaForCausalLM(llama_config(config))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]:
        raise ConfigError(f"weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    cast(torch.nn.Module, model).to(TORCH_DTYPES[dtype]).eval()
    return model
