"""A call of a router run that raised unexpectedly (``LegCrashed``, posted by the driver when a
leg's task dies): the run fails at once with ``leg_crashed`` naming the call and the exception,
releases RLD's slot, and takes no fallback; a superseded leg's crash is ignored; a crash while the
complete output only waits for P's reply ends the run finished, without waiting out the grace.
In memory on an injected clock (``_run_harness``)."""

from __future__ import annotations

from _run_harness import Run

from pddlink.lifecycle import (
    FailReason,
    FallbackTaken,
    LegCrashed,
    ReleaseRldSlot,
    RunEnded,
    RunOutcome,
    RunState,
)
from pddlink.roles import Role
from pddlink.routing import Pipeline


def test_a_crashed_stream_fails_the_run_at_once_with_its_name() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4])
    out = run.feed(LegCrashed.of("r", "md1", ValueError("Value out of range: -5")))
    assert run.m.state is RunState.ENDED
    assert any(isinstance(c, ReleaseRldSlot) for c in out)
    assert not any(isinstance(c, FallbackTaken) for c in out)
    assert isinstance(out[-1], RunEnded) and out[-1].outcome is RunOutcome.FAILED
    t = run.trace
    assert t.reason is FailReason.LEG_CRASHED
    assert t.reason_text == "leg_crashed: md1: ValueError: Value out of range: -5"
    assert t.e2e_s < 1.0  # at once, not at the deadline (10 s)


def test_an_exception_without_a_message_is_named_by_its_type() -> None:
    assert LegCrashed.of("r", "p1", KeyError()).error == "KeyError"
    assert len(LegCrashed.of("r", "p1", RuntimeError("x" * 1000)).error) == 300


def test_a_superseded_legs_crash_is_ignored() -> None:
    run = Run(Pipeline.P_MD)
    run.prefill()
    run.stream_end(Role.MD, "failed:unavailable")  # a new leg r#2 on RLD
    assert run.m.leg is not None and run.m.leg.sid == "r#2"
    assert run.feed(LegCrashed("r", "md1", "ValueError: late")) == []
    assert run.m.state is RunState.RUNNING


def test_a_crash_while_waiting_for_ps_reply_ends_the_complete_run_now() -> None:
    run = Run(Pipeline.P_MD, max_tokens=2)
    run.tokens(Role.MD, [4, 5])  # complete before P replied: the run waits up to 1 s for it
    assert run.m.state is RunState.AWAITING_P_REPLY
    out = run.feed(LegCrashed("r", "p1", "IndexError: list index out of range"))
    assert run.m.state is RunState.ENDED and isinstance(out[-1], RunEnded)
    assert run.trace.outcome is RunOutcome.FINISHED and run.trace.reason is None
