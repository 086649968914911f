"""``harness.vllm_exact``'s requests and its report, from rows (no vLLM started: the benchmark
itself runs on real vLLM servers, ``pddlink bench vllm-exact``)."""

from __future__ import annotations

from typing import Any

from harness.vllm_exact import ExactSpec, jobs, report


def test_jobs_split_greedy_and_seeded_over_both_modes_with_a_shared_prefix() -> None:
    spec = ExactSpec(requests=6, system_tokens=64)
    js = jobs(spec)
    assert len(js) == 12
    for mode in ("one_shot", "catch_up"):
        kinds = [s.temperature > 0 for m, _, s in js if m == mode]
        assert kinds.count(True) == 3 and kinds.count(False) == 3
    prompts = [p for _, p, _ in js]
    assert len({p[:64] for p in prompts}) == 1  # one system prefix (MD's DRC holds it)
    assert len(set(prompts)) == 12  # every request's own part is fresh
    seeds = [s.seed for _, _, s in js if s.temperature > 0]
    assert len(set(seeds)) == len(seeds)
    assert jobs(spec) == js  # the same requests on every run


def _row(mode: str, seeded: bool, *, exact: bool = True, outcome: str = "finished", **trace: Any) -> dict:
    t = {"handoff_outcome": "handed_off", "handoff_mode": mode, "tokens": {"rld": 5, "md": 195}} | trace
    return {
        "request": f"r-{mode}-{seeded}",
        "mode": mode,
        "seeded": seeded,
        "outcome": outcome,
        "reason": None if outcome == "finished" else "deadline_exceeded",
        "ordered": True,
        "trace": t,
        "exact": exact,
    }


def test_report_counts_mismatches_handoffs_and_failures_apart() -> None:
    rows = [
        _row("one_shot", False),
        _row("one_shot", True, exact=False),
        _row("catch_up", False, handoff_mode="one_shot"),  # the wrong mode is not counted as handed off
        _row("catch_up", True, outcome="failed", exact=False, tokens={}),  # a failure, not a mismatch
    ]
    rows[1]["divergence"] = {"position": 7, "top2_logprob_gap": 0.01}
    out = report(ExactSpec(requests=2), rows, {"p": {"held_slots": 0}})
    assert out["requests"] == 4 and out["greedy"] == 2 and out["seeded"] == 2
    assert out["failed"] == 1 and out["failures"] == ["r-catch_up-True: deadline_exceeded"]
    assert out["token_mismatches"] == 1
    assert out["divergences"] == [{"position": 7, "top2_logprob_gap": 0.01}]
    assert out["handed_off"] == 2
    assert out["tokens_from_both"] == 3
    assert out["by"]["seeded/one_shot"]["mismatches"] == 1
    assert out["by"]["greedy/catch_up"]["handed_off"] == 0
    assert out["by"]["greedy/one_shot"]["rld_tokens_before_handoff"] == {"mean": 5.0, "min": 5, "max": 5}
    assert out["by"]["greedy/catch_up"]["rld_tokens_before_handoff"] is None
