"""Sampling that continues exactly across vLLM instances: the token at a position depends only on
(seed, position) and the logits there, and the penalties see the request's whole output.

vLLM's own seeded sampling draws from a ``torch.Generator`` per request, whose state after k tokens
lives only in the instance that drew them: MainDecode, given the prompt plus RelayDecode's k tokens,
would start a fresh generator and continue another random sequence. ``PositionSeededSampling`` is a
vLLM v1 logits processor (``LLM(logits_processors=[PositionSeededSampling])`` or
``--logits-processors engines_adapter.vllm.sampling:PositionSeededSampling``) that takes the draw
over: for every seeded request with a temperature, at each step it applies vLLM's penalties
(repetition over prompt and output tokens, then frequency and presence over output tokens), then
``min_p``, and draws the token with the reference engine's rule
(``engines_adapter.torch_ref.sampling.draw_token``: temperature, top-k, top-p, then inverse CDF in
vocabulary order at ``uniform_draw(seed, position)``), and leaves only that token finite in the row,
so vLLM's sampler (penalties, temperature, min_p, top-k/top-p, its generator) can only pick it.
``logit_bias``, ``min_tokens``, ``allowed_token_ids`` and ``bad_words`` act before this processor
(vLLM's order: allowed ids, bad words, its built-in processors, then this one; then penalties).

A continuing leg's prompt ends with the request's own output so far (a handoff: MD gets prompt +
RelayDecode's k tokens). vLLM counts presence and frequency penalties over output tokens only, so
the leg says how many of its prompt's last tokens are output (``vllm_xargs``
``{"pddlink_prior_output": k}``, ``router.vllm_http``): for a seeded request the draw counts them
as output; for any other request with those penalties this processor corrects the row so that
vLLM's penalties, applied after it, give what they give for the whole output: the token's logit
``y`` is set so that ``rep(y) - vLLM's own terms == rep(x) - the whole output's terms`` (the tokens
concerned are all in the prompt, so vLLM's repetition scaling ``rep`` applies to them; exact up to
one float32 rounding of that scaling). Repetition penalty needs no correction: vLLM applies it over
prompt and output tokens both, the same set on every leg.

Where it runs: in the engine core's model runner (the worker process, or the caller's process
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), once per step on the float32 logits of the whole batch,
as a non-argmax-invariant processor (so before penalties and temperature). ``update_state`` keeps,
per batch row, the request's parameters, its prompt and a reference to its live output list: the
position of the token being drawn is ``len(prompt) + len(output so far)``, which is the same on
RelayDecode and on MainDecode continuing from prompt + k tokens. Greedy and unseeded requests
without a prior output are not touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from engines_adapter.torch_ref.sampling import draw_token

SAMPLING_EPS = 1e-5  # vLLM's own threshold below which a temperature means greedy
SEED_MASK = 2**63 - 1  # the reference engine's seed range; equal seeds in it draw alike
FQCN = "engines_adapter.vllm.sampling:PositionSeededSampling"
PRIOR_OUTPUT_ARG = "pddlink_prior_output"  # the prompt's last k tokens are the request's output


@dataclass(frozen=True, slots=True)
class _Row:
    seeded: bool
    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence: float
    frequency: float
    repetition: float
    prompt: list[int]
    prior: int  # the prompt's last ``prior`` tokens are output
    output: list[int]  # vLLM's live list of the request's generated ids (grows every step)

    @property
    def position(self) -> int:
        return len(self.prompt) + len(self.output)

    def output_counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        ids = self.prompt[len(self.prompt) - self.prior :] + list(self.output)
        return _counts(ids, vocab, device)


def _counts(ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    t = torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.int64, device=device)
    return torch.bincount(t, minlength=vocab)[:vocab].to(torch.float32)


def engages(params: SamplingParams) -> bool:
    """Whether a request's draws are position-keyed: seeded, with a temperature."""
    return params.seed is not None and params.temperature >= SAMPLING_EPS


def prior_output(params: SamplingParams) -> int:
    extra = params.extra_args or {}
    return max(0, int(extra.get(PRIOR_OUTPUT_ARG, 0) or 0))


def _row(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _Row | None:
    seeded = engages(params)
    prior = prior_output(params)
    corrects = prior > 0 and bool(params.presence_penalty or params.frequency_penalty)
    if prompt is None or not (seeded or corrects):
        return None
    return _Row(
        seeded=seeded,
        seed=(params.seed or 0) & SEED_MASK,
        temperature=params.temperature,
        top_k=max(params.top_k, 0),
        top_p=params.top_p,
        min_p=params.min_p,
        presence=params.presence_penalty,
        frequency=params.frequency_penalty,
        repetition=params.repetition_penalty,
        prompt=prompt,
        prior=min(prior, len(prompt)),
        output=output,
    )


def penalized(row: torch.Tensor, r: _Row) -> torch.Tensor:
    """vLLM's ``apply_penalties`` on one row, counting the prior output as output (a copy)."""
    out = row.clone()
    vocab = out.shape[0]
    counts = r.output_counts(vocab, out.device)
    if r.repetition != 1.0:
        seen = (_counts(r.prompt, vocab, out.device) + counts) > 0
        scale = torch.where(out > 0, 1.0 / r.repetition, r.repetition)
        out = torch.where(seen, out * scale, out)
    return out - r.frequency * counts - r.presence * (counts > 0).to(out.dtype)


def corrected(row: torch.Tensor, r: _Row) -> torch.Tensor:
    """The row vLLM's penalties (over the leg's own output only) turn into what they give over the
    whole output (prior + own); see the module docstring."""
    vocab = row.shape[0]
    whole = r.output_counts(vocab, row.device)
    own = _counts(list(r.output), vocab, row.device)
    d = r.frequency * (whole - own) + r.presence * ((whole > 0).to(row.dtype) - (own > 0).to(row.dtype))
    cols = torch.nonzero(d, as_tuple=True)[0]
    if cols.numel() == 0:
        return row
    x = row[cols]
    rep = r.repetition
    z = torch.where(x > 0, x * (1.0 / rep), x * rep) - d[cols]  # what vLLM's result must be
    row[cols] = torch.where(z > 0, z * rep, z / rep)  # vLLM scales it back to z (rep ** -1)
    return row


def _min_p(row: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """vLLM's min_p (after temperature): tokens below ``min_p`` x the top probability are out."""
    if min_p <= 0:
        return row
    floor = float(row.max()) + temperature * math.log(min_p)
    return row.masked_fill(row < floor, float("-inf"))


class PositionSeededSampling(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        value = extra.get(PRIOR_OUTPUT_ARG, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"vllm_xargs.{PRIOR_OUTPUT_ARG} must be a non-negative integer")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token: it must run before the sampler, greedy rows untouched

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self.rows.items():
            if index >= logits.shape[0]:
                continue
            if not row.seeded:
                logits[index] = corrected(logits[index], row)
                continue
            drawn = _min_p(penalized(logits[index], row), row.temperature, row.min_p)
            token = draw_token(drawn, row.temperature, row.top_k, row.top_p, row.seed, row.position)
            logits[index].fill_(float("-inf"))
            logits[index, token] = 0.0
        return logits
