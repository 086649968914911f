"""Token sampling whose randomness is a pure function of (seed, position).

The draw for the token at absolute position ``pos`` is one uniform number ``u`` derived from
``xxh3_64(seed, pos)``; the token is found by inverse CDF over the filtered distribution
(temperature, then top-k, then top-p: the filters rank tokens by probability, stably), laid out in
vocabulary order. No generator state is carried between steps, so any instance holding the same
logits draws the same token: that is what lets MainDecode continue exactly where RelayDecode
stopped.

Why vocabulary order and not the ranking: two instances hold equal logits only up to rounding
where their computations differ (a batch of two against one on a CPU GEMM, KV computed by decode
against by prefill: ``pddlink bench vllm-exact`` measures 4.8e-7 in logprobs). Over the ranking, a
rounding difference between two near-equal tokens swaps their places in the CDF and moves every
draw that lands in either one's segment (a random tiny model's near-flat distribution has such
near-ties at every step); over vocabulary order it moves a segment's edge by the rounding only. On
the tiny Llama's logits with noise of 1e-6 and 1e-5 x their largest magnitude, the ranked layout
changed 5 and 55 of 4,000 draws, vocabulary order 1 and 3 (``tests/engine/test_engine_sampling``
holds a near-tie). The distribution drawn from is the same.

Probabilities are computed in float64 whatever the model dtype. Shared by every adapter:
``draw_token`` is the rule itself, which the vLLM adapter's logits processor
(``engines_adapter.vllm.sampling``) calls too, so both engines draw alike from equal logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from engines_adapter.base import SamplingParams

_U53 = float(2**53)


def uniform_draw(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    digest = xxhash.xxh3_64_intdigest(seed.to_bytes(8, "little") + position.to_bytes(8, "little"))
    return (digest >> 11) / _U53


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> list[int]:
    """One token per row of ``logits`` ``[B, vocab]``; row ``b`` is drawn for ``positions[b]``."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    out: list[int] = []
    for row, (sp, pos) in enumerate(zip(params, positions, strict=True)):
        out.append(int(greedy[row]) if sp.greedy else _draw(logits[row], sp, pos))
    return out


def _draw(row: torch.Tensor, sp: SamplingParams, position: int) -> int:
    return draw_token(row, sp.temperature, sp.top_k, sp.top_p, sp.seed, position)


def draw_token(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, position: int
) -> int:
    """The token drawn from one row of raw logits ``[vocab]`` for absolute ``position``
    (``temperature > 0``; ``top_k`` 0 and ``top_p`` 1.0 switch those filters off)."""
    scaled = row.detach().to(device="cpu", dtype=torch.float64) / temperature
    order = torch.sort(scaled, descending=True, stable=True)
    values, index = order.values, order.indices
    if 0 < top_k < values.numel():
        values, index = values[:top_k], index[:top_k]
    probs = torch.softmax(values, dim=0)
    if top_p < 1.0:
        before = torch.cumsum(probs, dim=0) - probs  # mass of strictly more likely tokens
        keep = int((before < top_p).sum())  # the token that crosses top_p is kept
        probs, index = probs[:keep], index[:keep]
    back = torch.argsort(index)  # vocabulary order (see the module docstring)
    probs, index = probs[back], index[back]
    cdf = torch.cumsum(probs, dim=0)
    target = uniform_draw(seed, position) * float(cdf[-1])
    pick = min(
        int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)), len(cdf) - 1
    )
    return int(index[pick])
