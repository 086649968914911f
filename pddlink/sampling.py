"""How tokens are drawn: one value type for every engine, the router and the lifecycle machines.

It lives in the core (not in ``engines_adapter``) because the router's and the simulator's pure
machines carry it across a handoff without knowing any engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pddlink.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are drawn. A plain value: it travels to another instance with the handoff.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1.0`` disable those filters.
    Generation stops after ``max_tokens`` generated tokens or at any of ``stop_token_ids``.
    """

    seed: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise InvalidInput(f"sampling.seed must be in [0, 2**63), got {self.seed}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidInput(f"sampling.temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInput(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.max_tokens <= 1_000_000:
            raise InvalidInput(f"sampling.max_tokens must be in [1, 1000000], got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise InvalidInput(f"unknown sampling field(s): {', '.join(sorted(unknown))}")
        kw = dict(d)
        if "stop_token_ids" in kw:
            kw["stop_token_ids"] = tuple(int(t) for t in kw["stop_token_ids"])
        return cls(**kw)
