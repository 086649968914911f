"""Sampling that continues exactly across vLLM instances: the token at a position depends only on
(seed, position) and the logits there.

vLLM's own seeded sampling draws from a ``torch.Generator`` per request, whose state after k tokens
lives only in the instance that drew them: MainDecode, given the prompt plus RelayDecode's k tokens,
would start a fresh generator and continue another random sequence. ``PositionSeededSampling`` is a
vLLM v1 logits processor (``LLM(logits_processors=[PositionSeededSampling])`` or
``--logits-processors engines_adapter.vllm.sampling:PositionSeededSampling``) that takes the draw
over: for every seeded request with a temperature, at each step it draws the token with the
reference engine's rule (``engines_adapter.torch_ref.sampling.draw_token``: temperature, top-k,
top-p, then inverse CDF in vocabulary order at ``uniform_draw(seed, position)``) and leaves only
that token finite in the row, so vLLM's sampler (temperature, top-k/top-p, its generator) can only
pick it. Greedy and unseeded requests are not touched. Stop tokens, ``max_tokens`` and
``logit_bias`` / ``min_tokens`` (applied before this processor) hold as usual.

Where it runs: in the engine core's model runner (the worker process, or the caller's process
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), once per step on the float32 logits of the whole batch,
as a non-argmax-invariant processor (so before penalties and temperature). ``update_state`` keeps,
per batch row, the request's seed, filters, prompt length and a reference to its live output list:
the position of the token being drawn is ``len(prompt) + len(output so far)``, which is the same
on RelayDecode and on MainDecode continuing from prompt + k tokens. Requests that ask for
penalties or ``min_p`` together with seeded sampling are refused (HTTP 400): those would change the
distribution after this processor's draw.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class _Row:
    seed: int
    temperature: float
    top_k: int
    top_p: float
    prompt_len: int
    output: list[int]  # vLLM's live list of the request's generated ids (grows every step)

    @property
    def position(self) -> int:
        return self.prompt_len + len(self.output)


def engages(params: SamplingParams) -> bool:
    """Whether a request's draws are position-keyed: seeded, with a temperature."""
    return params.seed is not None and params.temperature >= SAMPLING_EPS


def _row(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _Row | None:
    if not engages(params) or prompt is None:
        return None
    assert params.seed is not None
    return _Row(
        params.seed & SEED_MASK, params.temperature, max(params.top_k, 0), params.top_p, len(prompt), output
    )


class PositionSeededSampling(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if not engages(sampling_params):
            return
        p = sampling_params
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.min_p:
            raise ValueError(
                "seeded sampling with pddlink's position-keyed draw takes temperature, top_k, top_p "
                "and stop tokens; penalties and min_p are not supported with it"
            )

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token: it must run before the sampler, greedy rows untouched

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self.rows.items():
            if index >= logits.shape[0]:
                continue
            token = draw_token(logits[index], row.temperature, row.top_k, row.top_p, row.seed, row.position)
            logits[index].fill_(float("-inf"))
            logits[index, token] = 0.0
        return logits
