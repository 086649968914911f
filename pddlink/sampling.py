"""How tokens are drawn: one value type for every engine, the router and the lifecycle machines.

It lives in the core (not in ``engines_adapter``) because the router's and the simulator's pure
machines carry it across a handoff without knowing any engine.

The first six fields are what every engine implements (the reference engine's sampler and its wire
``Sampling`` message); the rest are vLLM's own sampling fields, carried to vLLM's servers as they
are (``router.vllm_http.sampling_body``). ``vllm_only`` names those set away from their neutral
value, which an engine without them must refuse. ``after(n)`` is the request continued after ``n``
of its own output tokens, which the continuing leg sees as the end of its prompt (a handoff, a
fallback leg): ``max_tokens`` and ``min_tokens`` count what is left, ``prior_output_tokens`` says
how many of the prompt's last tokens are output (vLLM's presence and frequency penalties count
output tokens only: ``engines_adapter.vllm.sampling`` corrects for them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pddlink.errors import InvalidInput

MAX_LOGPROBS = 20  # vLLM's default ``max_logprobs``


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are drawn. A plain value: it travels to another instance with the handoff.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1.0`` disable those filters.
    Generation stops after ``max_tokens`` generated tokens or at any of ``stop_token_ids``.
    vLLM's fields (neutral by default): ``min_p``; ``presence_penalty``, ``frequency_penalty``
    (over output tokens) and ``repetition_penalty`` (over prompt and output tokens);
    ``logit_bias`` ((token id, bias) pairs); ``min_tokens`` (stop tokens masked until then);
    ``allowed_token_ids``; ``bad_words``; ``logprobs`` (top-N logprobs per token, None: none);
    ``prompt_logprobs`` (the prompt's, from the instance that prefills it: completions' ``echo``);
    ``logprobs_as_ids`` (the instances name logprob tokens by id, vLLM's
    ``return_tokens_as_token_ids``: the router spells them, ``router.logprob_text``).
    """

    seed: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # asked of the instance that prefills (echo with logprobs)
    structured: str = ""  # vLLM's structured-output fields, a JSON object (no handoff: see the router)
    logprobs_as_ids: bool = False
    prior_output_tokens: int = 0

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
        self._check_vllm_fields()

    def _check_vllm_fields(self) -> None:
        """vLLM's own bounds (``vllm.SamplingParams._verify_args``)."""
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidInput(f"sampling.min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidInput(f"sampling.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidInput(
                f"sampling.repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.min_tokens < 0:
            raise InvalidInput(f"sampling.min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise InvalidInput(f"sampling.{name} must be in [0, {MAX_LOGPROBS}], got {n}")
        if self.prior_output_tokens < 0:
            raise InvalidInput(f"sampling.prior_output_tokens must be >= 0, got {self.prior_output_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def after(self, n: int) -> SamplingParams:
        """The request continued after ``n`` of its output tokens, now the end of the leg's prompt."""
        if n == 0:
            return self
        return replace(
            self,
            max_tokens=self.max_tokens - n,
            min_tokens=max(0, self.min_tokens - n),
            prior_output_tokens=self.prior_output_tokens + n,
        )

    def vllm_only(self) -> tuple[str, ...]:
        """The fields set away from their neutral value that only vLLM implements."""
        return tuple(
            f.name
            for f in fields(self)[len(REFERENCE_FIELDS) :]
            if f.name != "prior_output_tokens" and getattr(self, f.name) != f.default
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        d["allowed_token_ids"] = list(self.allowed_token_ids)
        d["bad_words"] = list(self.bad_words)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise InvalidInput(f"unknown sampling field(s): {', '.join(sorted(unknown))}")
        kw = dict(d)
        for name in ("stop_token_ids", "allowed_token_ids"):
            if name in kw:
                kw[name] = tuple(int(t) for t in kw[name])
        if "logit_bias" in kw:
            kw["logit_bias"] = tuple((int(t), float(b)) for t, b in kw["logit_bias"])
        if "bad_words" in kw:
            kw["bad_words"] = tuple(str(w) for w in kw["bad_words"])
        return cls(**kw)


REFERENCE_FIELDS = ("seed", "temperature", "top_k", "top_p", "max_tokens", "stop_token_ids")
