"""Issue acceptance: P -> RLD -> MD produces exactly the tokens one engine produces alone.

Random (prompt length, handoff point, seed, sampling) cases over both adapters, greedy and seeded
sampling, some with MD reusing its own cached prefix and some handing over in two catch-up slices.
Everything runs in float64 (DESIGN.md: float32 results depend on batch composition); there the KV
that MD's extend recomputes must match the KV that decoding produced to 1e-9.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from _engine_testkit import (
    BLOCK,
    Roles,
    generate_alone,
    hf_engine,
    hf_model,
    kv_array,
    pdd_generate,
    torch_engine,
)

from engines_adapter.base import SamplingParams


@dataclass(frozen=True)
class Case:
    prompt: tuple[int, ...]
    sampling: SamplingParams
    handoff_tokens: int
    md_shared_prefix_blocks: int  # MD caches this many of the prompt's blocks beforehand
    catch_up_at: int | None

    def __str__(self) -> str:
        mode = "greedy" if self.sampling.greedy else f"T{self.sampling.temperature}"
        return f"L{len(self.prompt)}-k{self.handoff_tokens}-{mode}-pre{self.md_shared_prefix_blocks}"


def make_cases(n: int, seed: int, vocab: int) -> list[Case]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(1, 90)
        max_tokens = rng.randint(3, 14)
        k = rng.randint(1, max_tokens - 1)
        if i % 2:
            sp = SamplingParams(
                seed=rng.randrange(2**63),
                temperature=rng.choice([0.6, 1.0, 1.4]),
                top_k=rng.choice([0, 5, 50]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                max_tokens=max_tokens,
            )
        else:
            sp = SamplingParams(max_tokens=max_tokens)
        shared = rng.randint(1, length // BLOCK) if length >= BLOCK and rng.random() < 0.5 else 0
        catch_up = rng.randint(1, k - 1) if k >= 2 and rng.random() < 0.4 else None
        prompt = tuple(rng.randrange(vocab) for _ in range(length))
        out.append(Case(prompt, sp, k, shared, catch_up))
    return out


TORCH_CASES = make_cases(40, seed=11, vocab=2048)
HF_CASES = make_cases(16, seed=12, vocab=2048)


def _roles(factory) -> Roles:  # type: ignore[no-untyped-def]
    return Roles(p=factory(), rld=factory(), md=factory(), alone=factory())


@pytest.fixture(scope="module")
def torch_roles() -> Roles:
    return _roles(torch_engine)


@pytest.fixture(scope="module")
def hf_roles() -> Roles:
    pytest.importorskip("transformers")
    model = hf_model()  # the model holds no request state: the four roles share it
    return _roles(lambda: hf_engine(model))


_ids: Iterator[int] = iter(range(10**9))


def check_case(roles: Roles, case: Case) -> None:
    rid = f"req-{next(_ids)}"
    if case.md_shared_prefix_blocks:  # MD served an earlier request that shares this prompt's prefix
        shared = list(case.prompt[: case.md_shared_prefix_blocks * BLOCK])
        roles.md.prefill(f"{rid}-earlier", [*shared, 5, 6, 7], SamplingParams(max_tokens=2))
        roles.md.release(f"{rid}-earlier")
        assert roles.md.cached_prefix_tokens(case.prompt) >= len(shared)

    expected = generate_alone(roles.alone, rid, case.prompt, case.sampling)
    expected_kv = kv_array(roles.alone.export_kv(rid))
    roles.alone.release(rid)

    got = pdd_generate(
        roles, rid, case.prompt, case.sampling, case.handoff_tokens, catch_up_at=case.catch_up_at
    )
    assert got.tokens == expected
    assert got.rld_tokens == expected[: len(got.rld_tokens)]
    recomputed = got.md_kv_after_extend
    assert recomputed.shape[3] == len(case.prompt) + case.handoff_tokens
    np.testing.assert_allclose(recomputed, expected_kv[:, :, :, : recomputed.shape[3]], rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", TORCH_CASES, ids=str)
def test_pdd_matches_alone_torch_ref(torch_roles: Roles, case: Case) -> None:
    check_case(torch_roles, case)


@pytest.mark.hf
@pytest.mark.parametrize("case", HF_CASES, ids=str)
def test_pdd_matches_alone_hf(hf_roles: Roles, case: Case) -> None:
    check_case(hf_roles, case)


def test_cases_cover_both_modes_and_paths() -> None:
    cases = TORCH_CASES + HF_CASES
    assert len(cases) >= 50
    assert sum(c.sampling.greedy for c in cases) >= 20 and sum(not c.sampling.greedy for c in cases) >= 20
    assert sum(c.md_shared_prefix_blocks > 0 for c in cases) >= 10
    assert sum(c.catch_up_at is not None for c in cases) >= 5
    assert sum(c.handoff_tokens == 1 for c in cases) >= 1


@pytest.mark.parametrize("adapter", ["torch_ref", "hf"])
def test_chunked_prefill_and_extend_match_one_pass(adapter: str) -> None:
    """Long passes run in ``chunk_tokens`` pieces: same tokens, same KV (1e-9) as one pass."""
    if adapter == "hf":
        pytest.importorskip("transformers")
        model = hf_model()
        one_pass, chunked = hf_engine(model), hf_engine(model)
        chunked.chunk_tokens = 7
    else:
        one_pass, chunked = torch_engine(), torch_engine()
        chunked.chunk_tokens = 7
    rng = random.Random(3)
    prompt = [rng.randrange(2048) for _ in range(45)]
    sp = SamplingParams(seed=8, temperature=1.0, max_tokens=30)
    expected = generate_alone(one_pass, "r", prompt, sp)
    got = chunked.prefill("r", prompt, sp)
    assert got.token_id == expected[len(prompt)]
    chunked.release("r", cache_prefix=False)
    first = one_pass.export_kv("r", 0, len(prompt) // BLOCK)  # full prompt blocks only
    chunked.import_kv("x", prompt[: len(prompt) // BLOCK * BLOCK], [first], sp)
    out = chunked.extend(
        "x", expected[first.num_tokens : len(prompt) + 20]
    )  # 20 + a few tokens in pieces of 7
    assert out.token_id == expected[len(prompt) + 20]
    recomputed = kv_array(chunked.export_kv("x"))
    reference = kv_array(one_pass.export_kv("r"))[:, :, :, : recomputed.shape[3]]
    np.testing.assert_allclose(recomputed, reference, rtol=0, atol=1e-9)


@pytest.mark.hf
@pytest.mark.parametrize("arch", ["Qwen2", "Mistral"])
def test_hf_adapter_serves_other_architectures(arch: str) -> None:
    """Any transformers causal LM with a standard cache: random tiny Qwen2 (q/k/v biases) and Mistral."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).double().eval()
    roles = _roles(lambda: hf_engine(model))
    prompt = list(range(30, 67))
    for sp in (
        SamplingParams(max_tokens=9),
        SamplingParams(seed=4, temperature=1.0, top_p=0.9, max_tokens=9),
    ):
        rid = f"{arch}-{sp.temperature}"
        expected = generate_alone(roles.alone, rid, prompt, sp)
        assert pdd_generate(roles, rid, prompt, sp, 4, catch_up_at=2).tokens == expected
