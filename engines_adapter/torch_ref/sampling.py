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
``draw_tokens`` is the rule itself, over a batch of rows; ``draw_token``, one row of it, is what the
vLLM adapter's logits processor (``engines_adapter.vllm.sampling``) calls, so both engines draw alike
from equal logits.

Batched: one step's rows are drawn together, a few tensor operations for the whole batch. Drawn a row
at a time (a stable sort of the whole vocabulary each), sampling was half of a tiny-model decode
step at 16 rows on a CPU (2.75 of 5.15 ms); it is about 0.6 ms now.
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
    """One token per row of ``logits`` ``[B, vocab]``; row ``b`` is drawn for ``positions[b]``.

    Greedy rows take the argmax; the sampled rows are drawn together by ``draw_tokens``.
    """
    out = [0] * len(params)
    greedy = [b for b, sp in enumerate(params) if sp.greedy]
    rows = [b for b, sp in enumerate(params) if not sp.greedy]
    if greedy:  # argmax only where a row is greedy (a sampled batch pays nothing for it)
        picked = logits if len(greedy) == len(out) else logits[greedy]
        for b, tok in zip(greedy, torch.argmax(picked, dim=-1).tolist(), strict=True):
            out[b] = int(tok)
    if rows:
        picked = logits if len(rows) == len(out) else logits[rows]
        drawn = draw_tokens(
            picked,
            [params[b].temperature for b in rows],
            [params[b].top_k for b in rows],
            [params[b].top_p for b in rows],
            [uniform_draw(params[b].seed, positions[b]) for b in rows],
        )
        for b, tok in zip(rows, drawn, strict=True):
            out[b] = tok
    return out


def draw_token(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, position: int
) -> int:
    """The token drawn from one row of raw logits ``[vocab]`` for absolute ``position``
    (``temperature > 0``; ``top_k`` 0 and ``top_p`` 1.0 switch those filters off)."""
    return draw_tokens(row.unsqueeze(0), [temperature], [top_k], [top_p], [uniform_draw(seed, position)])[0]


def draw_tokens(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    uniform: Sequence[float],
) -> list[int]:
    """The rule, over ``B`` rows of raw logits ``[B, vocab]`` at once: row ``b`` is scaled by
    ``temperature[b]``, cut to its ``top_k[b]`` best (equal logits in vocabulary order, as a stable
    ranking keeps them), then to the tokens before ``top_p[b]`` of the mass in that ranking (the one
    that crosses it kept), and drawn by inverse CDF in vocabulary order at ``uniform[b]``.

    Rows are computed in groups of equal filters (the same ``top_k``, ``top_p`` on or off), each
    along the vocabulary on its own, so a row's token does not depend on the rows beside it:
    ``draw_token`` is this with ``B == 1``, and the tests hold the two equal. Only a row with
    ``top_p`` and no ``top_k`` ranks its whole vocabulary; a ``top_k`` row ranks its ``top_k``.
    """
    rows = logits.detach().to(device="cpu", dtype=torch.float64)
    vocab = rows.shape[1]
    scaled = rows / torch.tensor(temperature, dtype=torch.float64).unsqueeze(1)
    groups: dict[tuple[int, bool], list[int]] = {}
    for b, (tk, tp) in enumerate(zip(top_k, top_p, strict=True)):
        groups.setdefault((tk if 0 < tk < vocab else vocab, tp < 1.0), []).append(b)
    out = [0] * rows.shape[0]
    for (k, nucleus), members in groups.items():
        sub = scaled if len(members) == len(out) else scaled[members]
        cut = torch.tensor([top_p[b] for b in members], dtype=torch.float64).unsqueeze(1) if nucleus else None
        index, probs = _filtered(sub, k, cut)
        cdf = torch.cumsum(probs, dim=-1)
        target = torch.tensor([uniform[b] for b in members], dtype=torch.float64).unsqueeze(1) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, target, right=True)
        if bool((pick >= k).any()):  # a target rounded up to the whole mass: the last kept token
            last = k - 1 - torch.argmax(probs.flip(1).gt(0).to(torch.int8), dim=-1, keepdim=True)
            pick = torch.where(pick >= k, last, pick)
        for b, tok in zip(members, index.gather(1, pick).squeeze(1).tolist(), strict=True):
            out[b] = int(tok)
    return out


def _filtered(scaled: torch.Tensor, k: int, top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens ``[B, k]`` in vocabulary order and their probabilities after the top-k cut
    (``k`` < vocab) and the top-p cut (``top_p`` ``[B, 1]``; zero where cut)."""
    bsz, vocab = scaled.shape
    if k < vocab:
        kth = torch.topk(scaled, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        above, tied = scaled > kth, scaled == kth
        need = k - above.sum(dim=-1, keepdim=True)  # ties at the k-th value: the first in vocabulary order
        kept = above | (tied & (torch.cumsum(tied, dim=-1) <= need))
        index = kept.nonzero()[:, 1].view(bsz, k)  # row-major: each row's k tokens, ascending
        values = scaled.gather(1, index)
    else:
        index, values = torch.arange(vocab).expand(bsz, vocab), scaled
    if top_p is None:
        return index, torch.softmax(values, dim=-1)
    ranked, order = torch.sort(values, dim=-1, descending=True, stable=True)  # vocabulary order among equals
    probs = torch.softmax(ranked, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
    keep = (before < top_p).sum(dim=-1, keepdim=True)  # the token that crosses top_p is kept
    probs = probs.masked_fill(torch.arange(k).unsqueeze(0) >= keep, 0.0)
    return index, torch.zeros_like(probs).scatter_(1, order, probs)  # back in vocabulary order
