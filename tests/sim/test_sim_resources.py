"""The fluid prefill and decode resources against hand-computed schedules (the line: test_sim_wan)."""

from __future__ import annotations

from typing import Any

import pytest

from pddlink.sim.hardware import GPU_A, AFigures, InstanceModel
from pddlink.sim.resources import Clock, DecodeInstance, DecodeSeq, PrefillInstance


def _collect() -> tuple[dict[Any, float], Any]:
    done: dict[Any, float] = {}

    def cb(t: float, arg: Any) -> None:
        done[arg] = t

    return done, cb


def test_prefill_batches_share_one_fixed_cost() -> None:
    fig = AFigures(prefill_tok_s=0.001, prefill_attn_s=0.0, prefill_batch_s=0.5, prefill_batch_tokens=1000)
    clock = Clock()
    p = PrefillInstance(clock, InstanceModel(GPU_A, 1, fig), "p0")
    done, cb = _collect()
    p.submit(600, 0, 0.0, cb, "a")  # starts alone: 0.5 + 0.6
    p.submit(300, 0, 0.0, cb, "b")  # queued; b and c batch together next: 0.5 + 0.3 + 0.3
    p.submit(300, 0, 0.0, cb, "c")
    assert p.backlog_s(0.0) == pytest.approx(1.1 + 0.6)
    clock.run()
    assert done["a"] == pytest.approx(1.1) and done["b"] == done["c"] == pytest.approx(2.2)


def test_decode_batch_step_time_and_admission() -> None:
    fig = AFigures(decode_step_s=0.01, decode_seq_s=0.01, decode_kv_token_s=0.0, max_seqs_per_gpu=2)
    model = InstanceModel(GPU_A, 1, fig)
    clock = Clock()
    d = DecodeInstance(clock, model, "d0")
    done, cb = _collect()
    first, fcb = _collect()
    seqs = {n: DecodeSeq(t, 10, cb, n, fcb) for n, t in (("a", 10), ("b", 20), ("c", 5))}
    for s in seqs.values():
        d.admit(s, 0.0)
    assert d.load == 3 and d.queued == 1
    clock.run()
    # a, b run two at a time: 0.03 s per step; a done after 10 steps (0.3 s); c joins then.
    assert done["a"] == pytest.approx(0.3)
    assert done["c"] == pytest.approx(0.3 + 5 * 0.03)
    assert done["b"] == pytest.approx(0.45 + 5 * 0.02)
    assert first["c"] == pytest.approx(0.33)


def test_decode_remove_reports_tokens_so_far() -> None:
    fig = AFigures(decode_step_s=0.1, decode_seq_s=0.0, decode_kv_token_s=0.0)
    clock = Clock()
    d = DecodeInstance(clock, InstanceModel(GPU_A, 1, fig), "r0")
    done, cb = _collect()
    seq = DecodeSeq(100, 10, cb, "a", lambda t, a: None)
    d.admit(seq, 0.0)
    clock.run(until=1.05)
    assert d.remove(seq, 1.05) == 10
    clock.run()
    assert "a" not in done and d.load == 0


def test_running_progress_reads_each_sequences_tokens_without_advancing() -> None:
    """Two sequences at 0.03 s a step: by 0.3 s each has produced 10 tokens; a third joins then (a
    step takes 0.04 s from there); reading the progress twice gives the same and moves nothing."""
    fig = AFigures(decode_step_s=0.01, decode_seq_s=0.01, decode_kv_token_s=0.0)
    clock = Clock()
    d = DecodeInstance(clock, InstanceModel(GPU_A, 1, fig), "d0")
    _done, cb = _collect()
    for name in ("a", "b"):
        d.admit(DecodeSeq(100, 10, cb, name, lambda t, a: None), 0.0)
    clock.run(until=0.3)
    assert dict(d.running_progress(0.3)) == {"a": 10, "b": 10}
    d.admit(DecodeSeq(100, 10, cb, "c", lambda t, a: None), 0.3)
    assert dict(d.running_progress(0.3))["c"] == 0
    progress = dict(d.running_progress(0.5))  # 0.2 s at 0.04 s a step: 5 more each
    assert progress == {"a": 15, "b": 15, "c": 5} and dict(d.running_progress(0.5)) == progress
