"""Seeded sampling continues exactly across two vLLM instances (engines_adapter.vllm.sampling).

One seeded request generated whole on instance A, against the same request split: its first k
tokens on A, then prompt + those k tokens continued on instance B (a second vLLM engine, same
model directory). With ``PositionSeededSampling`` loaded the tokens are identical, float32, for
several k, temperature 0.8 / top-p 0.95 and top-k; greedy is unchanged; top-k 1 and a tiny top-p
equal greedy (the filters hold); a stop token ends the output where it is drawn. With penalties
(presence, frequency, repetition) and ``min_p``, greedy and seeded, the split continues exactly when
B is told how many of its prompt's last tokens are output (``vllm_xargs`` ``pddlink_prior_output``),
and differs somewhere without it (vLLM counts presence/frequency over output only). vLLM runs in a
child process (``python this_file OUT``) so its engine and environment do not leak into pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

PROMPTS = [[(7 * i + 13 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 31, 33, 70, 97, 130))]
MAX_TOKENS = 16
SPLITS = (1, 6, 15)
SEEDED = {"temperature": 0.8, "top_p": 0.95}
PRIOR = "pddlink_prior_output"
PENALISED = [
    {"temperature": 0.0, "presence_penalty": 1.0, "frequency_penalty": 1.5},
    {"temperature": 0.0, "presence_penalty": 0.7, "frequency_penalty": 0.9, "repetition_penalty": 1.3},
    {"temperature": 0.8, "seed": 11, "presence_penalty": 1.0, "frequency_penalty": 1.5},
    {"temperature": 0.8, "seed": 12, "frequency_penalty": 0.9, "repetition_penalty": 1.3, "min_p": 0.05},
]


def _run(out: Path) -> None:  # in the child: two vLLM engines, the runs, JSON out
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1"
    )
    from vllm import LLM, SamplingParams

    from engines_adapter.vllm.sampling import PositionSeededSampling
    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    model = build_tiny_llama(out.parent / "tiny-f32", TinyLlamaSpec(dtype="float32"))

    def engine() -> Any:
        return LLM(
            model=str(model), dtype="float32", block_size=32, enforce_eager=True, skip_tokenizer_init=True,
            max_model_len=1024, seed=0, logits_processors=[PositionSeededSampling],
        )  # fmt: skip

    def gen(llm: Any, jobs: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
        """One ``generate`` call (one batch) for all ``jobs`` of (prompt ids, sampling fields)."""
        params = [SamplingParams(detokenize=False, ignore_eos=True, **sp) for _, sp in jobs]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def seeded(i: int, n: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
        return {"max_tokens": n, "seed": 100 + i, **SEEDED, **extra}

    def each(**sp: Any) -> list[tuple[list[int], dict[str, Any]]]:
        return [(p, {"max_tokens": MAX_TOKENS, **sp}) for p in PROMPTS]

    t0 = time.monotonic()
    a = engine()
    timings = {"start_a_s": time.monotonic() - t0}
    result: dict[str, Any] = {}
    result["whole"] = [gen(a, [(p, seeded(i))])[0] for i, p in enumerate(PROMPTS)]  # one at a time
    result["batched"] = gen(a, [(p, seeded(i)) for i, p in enumerate(PROMPTS)])
    jobs = [(p, seeded(i, k)) for i, p in enumerate(PROMPTS) for k in SPLITS]
    result["first"] = gen(a, jobs)
    result["greedy"] = gen(a, each(temperature=0.0))
    result["top_k1"] = gen(a, each(seed=5, temperature=0.8, top_k=1))
    result["top_p_tiny"] = gen(a, each(seed=5, temperature=0.8, top_p=1e-6))
    result["top_k"] = gen(a, each(seed=9, temperature=1.5, top_k=3))
    stop = result["whole"][3][10]
    result["stop_token"] = stop
    result["stopped"] = gen(a, [(PROMPTS[3], seeded(3, stop_token_ids=[stop]))])[0]
    pen_jobs = [(p, {**sp, "max_tokens": MAX_TOKENS}) for p in PROMPTS[1:4] for sp in PENALISED]
    result["pen_whole"] = gen(a, pen_jobs)
    result["pen_first"] = gen(a, [(p, {**sp, "max_tokens": k}) for p, sp in pen_jobs for k in SPLITS])
    timings["runs_a_s"] = time.monotonic() - t0
    del a
    b = engine()
    timings["start_b_s"] = time.monotonic() - t0
    firsts = iter(result["first"])
    cont = [(p + next(firsts), seeded(i, MAX_TOKENS - k)) for i, p in enumerate(PROMPTS) for k in SPLITS]
    result["continued"] = gen(b, cont)
    result["greedy_b"] = gen(b, each(temperature=0.0))
    pen_firsts = iter(result["pen_first"])
    pen_cont = [
        (p + (f := next(pen_firsts)), {**sp, "max_tokens": MAX_TOKENS - k}, len(f))
        for p, sp in pen_jobs
        for k in SPLITS
    ]
    result["pen_continued"] = gen(b, [(p, {**sp, "extra_args": {PRIOR: k}}) for p, sp, k in pen_cont])
    result["pen_unaware"] = gen(b, [(p, sp) for p, sp, _ in pen_cont])
    result["timings"] = {**timings, "total_s": time.monotonic() - t0}
    out.write_text(json.dumps(result))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    out = tmp_path_factory.mktemp("vllm-sampling") / "runs.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_a_seeded_request_split_across_two_instances_continues_exactly(runs: dict[str, Any]) -> None:
    pairs = iter(zip(runs["first"], runs["continued"], strict=True))
    for i in range(len(PROMPTS)):
        whole = runs["whole"][i]
        assert len(whole) == MAX_TOKENS
        for k in SPLITS:
            first, rest = next(pairs)
            assert first == whole[:k], (i, k)
            assert first + rest == whole, (i, k)


def test_the_draw_is_random_per_seed_and_independent_of_the_batch(runs: dict[str, Any]) -> None:
    assert runs["batched"] == runs["whole"]
    assert all(w != g for w, g in zip(runs["whole"], runs["greedy"], strict=True))  # 0.8 really samples
    assert len({tuple(w) for w in runs["whole"]}) == len(PROMPTS)


def test_greedy_is_unchanged_and_filters_hold(runs: dict[str, Any]) -> None:
    assert runs["greedy"] == runs["greedy_b"]
    assert runs["top_k1"] == runs["greedy"]  # top-k 1: only the argmax survives
    assert runs["top_p_tiny"] == runs["greedy"]  # top-p ~0: only the most likely token
    assert runs["top_k"] != runs["greedy"]


def test_stop_tokens_still_end_the_output(runs: dict[str, Any]) -> None:
    stopped, stop = runs["stopped"], runs["stop_token"]
    whole = runs["whole"][3]
    assert stopped == whole[: whole.index(stop) + 1]


def test_penalties_continue_exactly_when_told_the_prior_output(runs: dict[str, Any]) -> None:
    firsts, conts, unaware = iter(runs["pen_first"]), iter(runs["pen_continued"]), iter(runs["pen_unaware"])
    differs = 0
    for n, whole in enumerate(runs["pen_whole"]):
        assert len(whole) == MAX_TOKENS
        for k in SPLITS:
            first, rest, plain = next(firsts), next(conts), next(unaware)
            assert first == whole[:k], (n, k)
            assert first + rest == whole, (n, k, PENALISED[n % len(PENALISED)])
            differs += first + plain != whole
    assert differs, "the prior output made no difference: the test shows nothing"
    # the penalties really act (greedy with penalties is not greedy)
    assert runs["pen_whole"][0] != runs["greedy"][1]


if __name__ == "__main__":
    _run(Path(sys.argv[1]))
