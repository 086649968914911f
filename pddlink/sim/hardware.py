"""Time and price models per hardware type: how long a prefill, a decode step and an extend take.

Everything is relative to the flagship GPU "A" (prices, speeds), as the published figures are:

- ``A``: prefill 1.0, decode 1.0, price 1.0 (P and RLD in datacenter A).
- ``E``: the published decode-leaning chip: prefill 0.81, decode 2.1 of A.
- ``B``: the MainDecode GPU; published only by price (1.2-1.3x A). Its speeds are not published; we
  take E's ratios for it (a decode-leaning part is why it sits on the decode side) and say so.

Absolute speeds of A (``AFigures``) are not published; they are the fitted parameters of the
calibrated scenario (see ``pddlink.sim.scenario``). The models:

- prefill of ``new`` tokens on top of ``cached`` ones, on an instance of ``g`` GPUs:
  ``(new * tok_s + new * (cached + new / 2) * attn_s) / (g * prefill_rel)``; a batch adds ``batch_s``;
- one decode iteration with ``n`` sequences holding ``ctx`` context tokens in total:
  ``(step_s + n * seq_s / g + ctx * kv_token_s / g) / decode_rel``;
- extend (MainDecode recomputing ``k`` handed-over token ids): ``extend_base_s + k * extend_token_s``,
  from the published 100-token token-id handoff (305 ms mean).
"""

from __future__ import annotations

from dataclasses import dataclass

from pddlink.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HardwareType:
    name: str
    prefill_rel: float
    decode_rel: float
    price_rel: float

    def __post_init__(self) -> None:
        if min(self.prefill_rel, self.decode_rel, self.price_rel) <= 0:
            raise ConfigError(f"hardware {self.name}: speeds and price must be > 0")


@dataclass(frozen=True, slots=True)
class AFigures:
    """Absolute speed of one A GPU (fitted) and the published handoff cost."""

    prefill_tok_s: float = 1.0 / 20000.0  # seconds per new prompt token per GPU
    prefill_attn_s: float = 1.6e-10  # seconds per (new token x context token) per GPU
    prefill_batch_s: float = 0.02  # fixed cost of one prefill batch
    prefill_batch_tokens: int = 32768  # new tokens one batch may carry
    decode_step_s: float = 0.012  # weights and fixed work of one iteration
    decode_seq_s: float = 0.00054  # per sequence in the batch, per GPU
    decode_kv_token_s: float = 2.2e-9  # per context token read, per GPU (4400 B at ~2 TB/s)
    kv_capacity_tokens_per_gpu: int = 6_000_000  # KV pool for running sequences (~26 GB at 4400 B)
    max_seqs_per_gpu: int = 48
    extend_base_s: float = 0.25
    extend_token_s: float = 0.00055  # 0.25 + 100 * 0.00055 = 0.305 s: the published mean

    def __post_init__(self) -> None:
        for name in ("prefill_tok_s", "decode_step_s", "extend_base_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.prefill_batch_tokens < 1 or self.max_seqs_per_gpu < 1 or self.kv_capacity_tokens_per_gpu < 1:
            raise ConfigError(
                "prefill_batch_tokens, max_seqs_per_gpu and kv_capacity_tokens_per_gpu must be >= 1"
            )


GPU_A = HardwareType("A", prefill_rel=1.0, decode_rel=1.0, price_rel=1.0)
CHIP_E = HardwareType("E", prefill_rel=0.81, decode_rel=2.1, price_rel=1.0)


def gpu_b(price_rel: float = 1.25, *, like: HardwareType = CHIP_E) -> HardwareType:
    """MainDecode's GPU: published price, speeds taken from ``like`` (default: chip E's ratios)."""
    return HardwareType("B", like.prefill_rel, like.decode_rel, price_rel)


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """The time model of one instance: ``gpus`` GPUs of one hardware type."""

    hw: HardwareType
    gpus: int
    fig: AFigures

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"an instance needs >= 1 GPU, got {self.gpus}")

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        f = self.fig
        work = new_tokens * f.prefill_tok_s + new_tokens * (cached_tokens + new_tokens / 2) * f.prefill_attn_s
        return work / (self.gpus * self.hw.prefill_rel)

    def step_s(self, seqs: int, context_tokens: int) -> float:
        f = self.fig
        per_gpu = (seqs * f.decode_seq_s + context_tokens * f.decode_kv_token_s) / self.gpus
        return (f.decode_step_s + per_gpu) / self.hw.decode_rel

    def extend_s(self, tokens: int) -> float:
        return (self.fig.extend_base_s + tokens * self.fig.extend_token_s) / self.hw.prefill_rel

    @property
    def kv_capacity_tokens(self) -> int:
        return self.gpus * self.fig.kv_capacity_tokens_per_gpu

    @property
    def max_seqs(self) -> int:
        return self.gpus * self.fig.max_seqs_per_gpu

    @property
    def price(self) -> float:
        return self.gpus * self.hw.price_rel
