"""A router run's token stream and its client cancel, in memory on an injected clock.

Tokens arrive out of order, twice, from two decoders and from superseded legs; the run must emit
each position once, in order, and count a disagreement. A client cancel in every state ends the
run at once with ``cancelled`` (or ``finished`` when the output is complete) and releases RLD's
slot; nothing comes out after the end.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _run_harness import BASE, Run, tok

from pddlink.lifecycle import (
    Emit,
    FailReason,
    ReleaseRldSlot,
    RunEnded,
    RunOutcome,
    RunState,
    StreamEnded,
    TokenArrived,
)
from pddlink.lifecycle.outcomes import StreamClosed
from pddlink.roles import Role
from pddlink.routing import Pipeline


def test_out_of_order_tokens_wait_for_the_gap() -> None:
    run = Run(Pipeline.P_RLD_MD)
    assert run.tokens(Role.RLD, [6, 5]) == []
    out = run.tokens(Role.RLD, [4])
    assert [c.token.position for c in out if isinstance(c, Emit)] == [4, 5, 6]


def test_duplicates_are_dropped_and_a_different_id_is_counted() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5])
    assert run.tokens(Role.MD, [4, 5]) == []  # the same tokens from MD after the handoff
    assert run.feed(TokenArrived("r", Role.MD, 5, 999)) == []  # and a different one
    run.tokens(Role.MD, [6, 7, 8, 9])
    assert run.exact()
    assert run.trace.divergences == 1 and run.trace.tokens == (("rld", 2), ("md", 4))


def test_tokens_past_the_end_are_ignored() -> None:
    run = Run(Pipeline.P_MD, max_tokens=2)
    run.prefill()
    run.tokens(Role.MD, [4, 5])
    assert run.m.state is RunState.ENDED
    assert run.feed(TokenArrived("r", Role.MD, 6, tok(6))) == []
    assert run.trace.output_tokens == 2


def test_a_superseded_leg_counts_only_for_its_tokens() -> None:
    run = Run(Pipeline.P_MD)
    run.prefill()
    run.tokens(Role.MD, [4])
    run.stream_end(Role.MD, "failed:unavailable")  # new leg r#2 on RLD
    assert run.m.leg is not None and run.m.leg.sid == "r#2"
    assert run.stream_end(Role.MD, "failed:unavailable", sid="r") == []  # the old leg's end: ignored
    assert run.m.state is RunState.RUNNING
    out = run.tokens(Role.MD, [5], sid="r")  # a late token of the old leg still fills position 5
    assert [c.token.position for c in out if isinstance(c, Emit)] == [5]


def test_handoff_mode_is_recorded_from_any_leg_stream() -> None:
    from pddlink.handoff import HandoffMode

    run = Run(Pipeline.P_RLD_MD)
    run.feed(StreamEnded("old", Role.RLD, StreamClosed.parse("handed_off"), HandoffMode.CATCH_UP))
    assert run.m.notes.handoff_mode is HandoffMode.CATCH_UP


# -- client cancel in every state -------------------------------------------------------------


def _before_p_reply() -> Run:
    return Run(Pipeline.P_RLD_MD)


def _rld_streaming() -> Run:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5])
    return run


def _md_streaming_after_handoff() -> Run:
    run = _rld_streaming()
    run.handoff("handed_off")
    run.stream_end(Role.RLD, "handed_off")
    run.tokens(Role.MD, [6])
    return run


def _after_takeover() -> Run:
    run = _rld_streaming()
    run.stream_end(Role.RLD, "failed:unavailable")
    return run


def _on_a_fallback_leg() -> Run:
    run = Run(Pipeline.P_MD)
    run.prefill(md_ok=False)
    return run


CANCEL_STATES: dict[str, tuple[Callable[[], Run], bool]] = {
    "before_p_reply": (_before_p_reply, True),
    "rld_streaming": (_rld_streaming, True),
    "md_streaming_after_handoff": (_md_streaming_after_handoff, False),
    "after_takeover": (_after_takeover, False),
    "on_a_fallback_leg": (_on_a_fallback_leg, True),
}


@pytest.mark.parametrize("state", list(CANCEL_STATES))
def test_client_cancel_ends_the_run_as_cancelled(state: str) -> None:
    make, rld_held = CANCEL_STATES[state]
    run = make()
    assert run.m.state is RunState.RUNNING
    out = run.cancel()
    assert out[-1] == RunEnded(RunOutcome.FAILED)
    assert (ReleaseRldSlot() in out) is rld_held
    assert run.trace.reason is FailReason.CANCELLED and run.trace.reason_text == "cancelled"
    assert run.tokens(Role.MD, [7, 8]) == [] and run.cancel() == []  # nothing after the end
    assert run.m.get_timer() is None


def test_cancel_while_waiting_for_p_reply_still_finishes() -> None:
    run = Run(Pipeline.P_MD, max_tokens=2)
    run.tokens(Role.MD, [4, 5])
    assert run.m.state is RunState.AWAITING_P_REPLY
    assert run.cancel() == [RunEnded(RunOutcome.FINISHED)]
    assert run.trace.outcome is RunOutcome.FINISHED and run.trace.reason is None


def test_trace_dict_has_the_keys_clients_read() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill(md_cached_tokens=16, fast_path="tcp")
    run.tokens(Role.RLD, range(BASE, BASE + 6))
    d = run.trace.to_dict()
    for key in ("pipeline", "decision_reason", "fallbacks", "handoff_mode", "outcome", "reason", "ttft_s"):
        assert key in d
    assert d["outcome"] == "finished" and d["pipeline"] == "p_rld_md" and d["fast_path"] == "tcp"
    assert d["tokens"] == {"rld": 6} and d["ttft_s"] == pytest.approx(0.02)
