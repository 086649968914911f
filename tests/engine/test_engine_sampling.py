"""Sampling: the draw at a position depends only on (seed, position); filters behave as documented."""

from __future__ import annotations

import torch
from _engine_testkit import generate_alone, torch_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from engines_adapter.base import SamplingParams
from engines_adapter.torch_ref.sampling import draw_token, draw_tokens, sample_tokens, uniform_draw


@given(st.integers(0, 2**63 - 1), st.integers(0, 2**31))
def test_uniform_draw_is_a_pure_function_in_range(seed: int, pos: int) -> None:
    u = uniform_draw(seed, pos)
    assert 0.0 <= u < 1.0
    assert u == uniform_draw(seed, pos)


def test_draws_differ_across_positions_and_seeds() -> None:
    draws = {uniform_draw(s, p) for s in range(20) for p in range(50)}
    assert len(draws) == 1000


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    st.integers(0, 2**63 - 1),
    st.integers(0, 10_000),
    st.sampled_from([0.3, 1.0, 2.5]),
    st.integers(0, 6),
    st.sampled_from([0.2, 0.7, 1.0]),
)
def test_sampled_token_respects_top_k_and_top_p(logits, seed, pos, temp, top_k, top_p) -> None:  # type: ignore[no-untyped-def]
    row = torch.tensor([logits], dtype=torch.float64)
    sp = SamplingParams(seed=seed, temperature=temp, top_k=top_k, top_p=top_p)
    tok = sample_tokens(row, [sp], [pos])[0]
    assert tok == sample_tokens(row, [sp], [pos])[0]
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    rank = order.index(tok)
    if top_k:
        assert rank < top_k or logits[tok] == logits[order[top_k - 1]]
    probs = torch.softmax(row[0] / temp, 0)
    mass_before = float(sum(probs[i] for i in order[:rank]))
    assert mass_before < top_p + 1e-9 or logits[tok] == logits[order[rank - 1]]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300, dtype=torch.float64)
    greedy = logits.argmax(-1).tolist()
    for sp in (
        SamplingParams(seed=3, temperature=1.0, top_k=1),
        SamplingParams(seed=3, temperature=1.0, top_p=1e-9),
    ):
        assert sample_tokens(logits, [sp] * 16, list(range(16))) == greedy


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    sp = SamplingParams(seed=11, temperature=1.0)
    counts = [0, 0, 0]
    for pos in range(4000):
        counts[sample_tokens(logits, [sp], [pos])[0]] += 1
    assert abs(counts[0] / 4000 - 0.5) < 0.03 and abs(counts[2] / 4000 - 0.2) < 0.03


def test_the_distribution_holds_when_vocabulary_order_is_not_the_ranking() -> None:
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.05, 0.25]], dtype=torch.float64))
    sp = SamplingParams(seed=5, temperature=1.0, top_p=0.9)  # the 0.05 token is cut
    counts = [0, 0, 0, 0]
    for pos in range(6000):
        counts[sample_tokens(logits, [sp], [pos])[0]] += 1
    assert counts[2] == 0
    for tok, p in ((0, 0.2 / 0.95), (1, 0.5 / 0.95), (3, 0.25 / 0.95)):
        assert abs(counts[tok] / 6000 - p) < 0.025, counts


def test_rounding_between_near_tied_tokens_does_not_move_the_draws() -> None:
    """Two near-equal top tokens whose order a rounding difference swaps (as two instances'
    logits differ in the last bits): every draw stays the same. Over the probability ranking
    the draws landing in either token's segment (about half of them here) changed."""
    torch.manual_seed(3)
    row = torch.randn(64, dtype=torch.float64)
    row[7], row[40] = 3.0, 3.0 - 1e-12
    swapped = row.clone()
    swapped[40] = 3.0 + 1e-12
    sp = SamplingParams(seed=17, temperature=0.8, top_p=0.95)
    a = sample_tokens(row.expand(400, 64), [sp] * 400, list(range(400)))
    b = sample_tokens(swapped.expand(400, 64), [sp] * 400, list(range(400)))
    assert {7, 40} <= set(a)  # the tied tokens are drawn often: the case is exercised
    assert a == b


def _one_row_at_a_time(row: torch.Tensor, temp: float, top_k: int, top_p: float, u: float) -> int:
    """The rule spelt out for one row: rank stably, cut, softmax, back to vocabulary order, invert."""
    values, index = torch.sort(row.double() / temp, descending=True, stable=True)
    if 0 < top_k < values.numel():
        values, index = values[:top_k], index[:top_k]
    probs = torch.softmax(values, dim=0)
    if top_p < 1.0:
        keep = int(((torch.cumsum(probs, dim=0) - probs) < top_p).sum())
        probs, index = probs[:keep], index[:keep]
    back = torch.argsort(index)
    cdf = torch.cumsum(probs[back], dim=0)
    pick = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return int(index[back][min(pick, len(cdf) - 1)])


def test_a_batch_draws_what_each_row_draws_alone_whatever_its_neighbours() -> None:
    """The batched rule is the one-row rule: the same token for every row, with the filters mixed
    across the batch, ties at the k-th value and cut (-inf) logits among the rows."""
    gen = torch.Generator().manual_seed(7)
    n, vocab = 300, 512
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 3
    logits[::5, 40:60] = logits[::5, 40:41]  # twenty equal logits, some of them at the k-th place
    logits[1::7, 100:400] = float("-inf")  # a processor's cut before the draw (vLLM's min_p, bad words)
    filters = [(0.8, 64, 1.0), (1.0, 0, 0.9), (0.5, 8, 0.7), (1.3, 0, 1.0), (0.8, 1, 1.0), (2.0, 600, 0.95)]
    temp, top_k, top_p = zip(*(filters[i % len(filters)] for i in range(n)), strict=True)
    u = [uniform_draw(99, i) for i in range(n)]
    batched = draw_tokens(logits, temp, top_k, top_p, u)
    alone = [draw_tokens(logits[i : i + 1], [temp[i]], [top_k[i]], [top_p[i]], [u[i]])[0] for i in range(n)]
    assert batched == alone
    assert batched == [_one_row_at_a_time(logits[i], temp[i], top_k[i], top_p[i], u[i]) for i in range(n)]
    assert len(set(batched)) > 100  # the rows drew from their distributions, not one token


def test_ties_at_the_top_k_boundary_keep_the_first_in_vocabulary_order() -> None:
    row = torch.full((64,), -5.0, dtype=torch.float64)
    row[[3, 9, 12, 20]] = 2.0  # four equal best tokens, two kept
    drawn = {draw_token(row, 1.0, 2, 1.0, 5, pos) for pos in range(400)}
    assert drawn == {3, 9}


def test_seeded_generation_is_reproducible_and_seed_dependent() -> None:
    a, b = torch_engine(), torch_engine()
    prompt = list(range(100, 140))
    sp = SamplingParams(seed=42, temperature=1.0, max_tokens=12)
    first = generate_alone(a, "r", prompt, sp)
    assert first == generate_alone(b, "r", prompt, sp)
    other = generate_alone(b, "s", prompt, SamplingParams(seed=43, temperature=1.0, max_tokens=12))
    assert other != first


def test_stop_token_and_max_tokens_finish() -> None:
    eng = torch_engine()
    prompt = list(range(50, 70))
    greedy = generate_alone(eng, "g", prompt, SamplingParams(max_tokens=8))
    generated = greedy[len(prompt) :]
    assert len(generated) == 8
    stop = generated[3]
    first_stop = generated.index(stop)
    out = generate_alone(eng, "s", prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    assert out[len(prompt) :] == generated[: first_stop + 1]
    assert eng.is_finished("s")


def test_sampling_params_travel_as_plain_values() -> None:
    sp = SamplingParams(seed=9, temperature=0.7, top_k=40, top_p=0.9, max_tokens=33, stop_token_ids=(2, 5))
    assert SamplingParams.from_dict(sp.to_dict()) == sp
