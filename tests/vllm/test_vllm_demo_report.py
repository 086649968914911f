"""The vLLM demo's PDD figures (``harness.vllm_demo_report.pdd_report``) from request records: the
handoffs counted by kind only when tokens were handed over (a one-shot "handoff" before RLD's
first token is MD doing the whole request), RLD's token share, the TTFT P90 ratio, what is held."""

from __future__ import annotations

from typing import Any

from engines_adapter import SamplingParams
from harness.vllm_demo_report import Done, pdd_report

HELD = {"held_slots": 0, "held_bytes": 0, "in_flight": 0}


def _done(i: int, ttft: float, tokens: dict[str, int], outcome: str = "", mode: str = "") -> Done:
    trace: dict[str, Any] = {"pipeline": "p_rld_md", "ttft_s": ttft, "tokens": tokens, "fallbacks": []}
    if outcome:
        trace.update(handoff_outcome=outcome, handoff_mode=mode)
    return Done(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=128), (7,) * 128, trace)


def test_handoffs_share_and_ratio() -> None:
    done = [
        _done(0, 0.2, {"rld": 40, "md": 88}, "handed_off", "one_shot"),
        _done(1, 0.3, {"rld": 70, "md": 58}, "handed_off", "catch_up"),
        _done(2, 0.4, {"rld": 128}),  # finished on RLD before MD held the KV
        _done(3, 0.5, {"md": 128}, "handed_off:before_rld_first_token", "one_shot"),
    ]
    pdd = {"done": done, "failed": [], "divergences": [], "ttft": [d.trace["ttft_s"] for d in done]}
    base = {"ttft": [1.0] * 4}
    r = pdd_report(base, pdd, {"p": HELD, "rld": HELD, "md": HELD})
    assert r["handoffs"] == {"one_shot": 1, "catch_up": 1}
    assert r["tokens"] == {"rld": 238, "md": 274}
    assert abs(r["rld_token_share"] - 238 / 512) < 1e-9
    assert r["rld_token_share_why"]["requests_handed_off"] == 2
    assert r["rld_token_share_why"]["rld_tokens_before_handoff_mean"] == 55.0
    assert abs(r["p90_ratio"] - 0.47) < 1e-9  # P90 of 0.2..0.5 (numpy's linear) against 1.0
    assert r["pdd"]["requests"] == 4 and r["pdd"]["failed"] == 0
    assert r["pdd"]["held"]["md"] == HELD
