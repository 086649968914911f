"""A tiny random Llama and its tokenizer, built locally: what the vLLM tests and demo serve.

Nothing is downloaded. ``build_tiny_llama(dir)`` writes a Hugging Face model directory (config,
safetensors weights, a byte-level BPE tokenizer trained on a fixed local corpus) that
``vllm serve DIR`` and ``transformers`` both load. The same seed gives the same weights, so two
vLLM instances built from one directory compute the same logits. Building takes a few seconds;
an existing directory with the same spec is reused (``spec.json`` records what was built).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# A fixed corpus for the tokenizer: enough distinct words for a vocabulary of ~1k merges.
_WORDS = [
    "prefill",
    "decode",
    "relay",
    "main",
    "datacenter",
    "wan",
    "line",
    "cache",
    "prefix",
    "block",
    "token",
    "stream",
    "handoff",
    "router",
    "sidecar",
    "transfer",
    "chunk",
    "window",
    "ack",
    "deadline",
    "lease",
    "mirror",
    "index",
    "radix",
    "hash",
    "scheme",
    "tenant",
    "model",
    "layer",
    "head",
    "tensor",
    "bytes",
    "codec",
    "plane",
    "zstd",
    "quic",
    "tcp",
    "rdma",
    "verbs",
    "stripe",
    "pace",
    "loss",
    "delay",
    "rate",
    "queue",
    "outage",
    "fallback",
    "recompute",
    "extend",
    "sample",
    "seed",
    "greedy",
    "top",
    "temperature",
]


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """What to build. The defaults are MEASURED.md's tiny model (3.3 MB in bf16)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16384
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype {self.dtype!r}: one of bfloat16, float16, float32")


_SYLLABLES = [
    "ka",
    "ri",
    "to",
    "mu",
    "sen",
    "da",
    "vo",
    "li",
    "pe",
    "zu",
    "ran",
    "ko",
    "hi",
    "ne",
    "ta",
    "mo",
    "gu",
    "shi",
    "be",
    "ya",
]


def _corpus(lines: int = 6000) -> list[str]:
    """Domain words plus made-up ones from syllables, so BPE fills the whole vocabulary."""
    import random

    rng = random.Random(0)  # fixed: the same tokenizer on every build
    made_up = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(4000)]
    words = list(_WORDS) + made_up
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(lines)]


def _build_tokenizer(spec: TinyLlamaSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    # A minimal chat template so /v1/chat/completions works against the model.
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(str(out))


def build_tiny_llama(out_dir: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Build (or reuse) the tiny model directory ``out_dir``; returns its path."""
    spec = spec or TinyLlamaSpec()
    out = Path(out_dir)
    marker = out / "spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(spec, out)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))  # type: ignore[no-untyped-call]
    model.save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(asdict(spec)))
    return out
