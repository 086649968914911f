"""Every fallback of a router run, in memory on an injected clock (no processes).

Each scenario drives one ``RequestRun`` the way the sidecars would answer and checks the commands
it gives (which RPCs, which streams cancelled, which new leg) and how the request ends. The last
test removes each row of the fallback table in turn and checks that its scenario then ends
differently: no row is dead, and every scenario depends on the row it names.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _run_harness import BASE, PROMPT, Run, tok

from pddlink.lifecycle import (
    MAX_LEGS,
    CancelStreams,
    DetachHandoff,
    FailReason,
    Fallback,
    FallbackTaken,
    OpenStream,
    PrefillFailed,
    ReleaseRldSlot,
    RunEnded,
    RunOutcome,
    RunState,
    SendPrefill,
    StartHandoff,
    TakeOver,
    TakeoverFailed,
)
from pddlink.lifecycle import fallbacks as fallback_table
from pddlink.roles import Role
from pddlink.routing import Pipeline

# -- the happy paths ------------------------------------------------------------------------------


def test_p_md_opens_md_and_prefills_then_finishes_on_md() -> None:
    run = Run(Pipeline.P_MD)
    assert run.log == [
        OpenStream(Role.MD, run.m.leg),  # type: ignore[arg-type]
        SendPrefill(run.m.leg, ship_to_md=True, ship_to_rld=False, first_token_to_md=True),  # type: ignore[arg-type]
    ]
    run.prefill()
    run.tokens(Role.MD, range(BASE, BASE + 6))
    assert run.exact() and run.m.state is RunState.ENDED
    assert run.trace.outcome is RunOutcome.FINISHED and run.trace.fallbacks == ()
    assert run.trace.tokens == (("md", 6),) and run.trace.wan_bytes == 100


def test_p_rld_md_asks_rld_to_hand_off_once_p_replied() -> None:
    run = Run(Pipeline.P_RLD_MD)
    assert {c.on for c in run.of(OpenStream)} == {Role.RLD, Role.MD}  # type: ignore[attr-defined]
    assert run.of(StartHandoff) == []
    run.tokens(Role.RLD, [4, 5])
    run.prefill()
    assert run.of(StartHandoff) == [StartHandoff("r")]
    run.handoff("handed_off")
    run.stream_end(Role.RLD, "handed_off")
    run.tokens(Role.MD, [6, 7, 8, 9])
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED
    assert run.trace.to_dict()["handoff_outcome"] == "handed_off"
    assert run.trace.tokens == (("rld", 2), ("md", 4))


# -- MD unreachable / lost ------------------------------------------------------------------------


def test_md_unreachable_before_first_token_reruns_on_rld() -> None:
    run = Run(Pipeline.P_MD)
    out = run.prefill(md_ok=False, md_error="wan: connection refused")
    assert CancelStreams(Role.MD) in out and FallbackTaken(Fallback.MD_UNREACHABLE_P_RLD) in out
    leg = run.m.leg
    assert leg is not None and leg.sid == "r#2" and leg.pipeline is Pipeline.SINGULAR and leg.prompt == PROMPT
    assert OpenStream(Role.RLD, leg) in out
    run.prefill("r#2")
    run.tokens(Role.RLD, range(BASE, BASE + 6), sid="r#2")
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED
    assert run.trace.to_dict()["md_error"] == "wan: connection refused"


def test_md_unreachable_without_rld_fails_with_the_reason() -> None:
    run = Run(Pipeline.P_MD, rld_usable=False)
    run.prefill(md_ok=False, md_error="wan down")
    assert run.trace.outcome is RunOutcome.FAILED and run.trace.reason is FailReason.MD_UNREACHABLE
    assert run.trace.reason_text == "md_unreachable: wan down"


def test_md_unreachable_while_rld_cools_down_still_reruns_on_a_reachable_rld() -> None:
    """RLD marked down after another request failed there keeps new placements off it, but a
    request MD has lost has no better decoder: it is rescued on RLD while RLD's channel is up."""
    run = Run(Pipeline.P_MD, rld_usable=False, rld_reachable=True)
    out = run.prefill(md_ok=False, md_error="peer_unreachable: the WAN is silent")
    assert FallbackTaken(Fallback.MD_UNREACHABLE_P_RLD) in out
    run.prefill("r#2")
    run.tokens(Role.RLD, range(BASE, BASE + 6), sid="r#2")
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED


def test_rld_lost_while_rld_cools_down_but_reachable_still_reruns_on_md() -> None:
    """The cool-down still counts where RLD itself failed: the P->MD rerun row reads rld_usable."""
    run = Run(Pipeline.SINGULAR, max_tokens=3, rld_reachable=True)
    run.prefill()
    run.tokens(Role.RLD, [4])
    run.rld_usable = False
    out = run.stream_end(Role.RLD, "failed:unavailable")
    assert FallbackTaken(Fallback.RLD_LOST_P_MD) in out


def test_wan_transfer_past_its_deadline_on_the_relayed_path_lets_rld_finish() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.tokens(Role.RLD, [4, 5])
    out = run.prefill(md_ok=False, md_error="transfer deadline exceeded")
    assert FallbackTaken(Fallback.MD_UNREACHABLE_RLD_FINISHES) in out and CancelStreams(Role.MD) in out
    assert run.of(StartHandoff) == [] and run.m.legs == 1
    run.tokens(Role.RLD, [6, 7, 8, 9])
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED


def test_md_lost_after_the_first_token_reruns_the_rest_on_rld() -> None:
    run = Run(Pipeline.P_MD)
    run.prefill()
    run.tokens(Role.MD, [4, 5])
    out = run.stream_end(Role.MD, "failed:unavailable")
    assert FallbackTaken(Fallback.MD_LOST_P_RLD) in out
    leg = run.m.leg
    assert leg is not None and leg.prompt == (*PROMPT, tok(4), tok(5)) and leg.sampling.max_tokens == 4
    run.prefill("r#2")
    run.tokens(Role.RLD, [6, 7, 8, 9], sid="r#2")
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED


def test_md_lost_while_rld_streams_lets_rld_finish_and_detaches_the_handoff() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5])
    out = run.stream_end(Role.MD, "failed:unavailable")
    assert FallbackTaken(Fallback.MD_LOST_RLD_FINISHES) in out and DetachHandoff() in out
    run.tokens(Role.RLD, [6, 7, 8, 9])
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED


def test_md_lost_after_the_handoff_reruns_on_rld() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5])
    run.handoff("handed_off")
    run.stream_end(Role.RLD, "handed_off")
    out = run.stream_end(Role.MD, "failed:internal")
    assert FallbackTaken(Fallback.MD_LOST_P_RLD) in out and run.m.leg is not None and run.m.leg.sid == "r#2"


def test_md_lost_without_rld_fails() -> None:
    run = Run(Pipeline.P_MD, rld_usable=False)
    run.prefill()
    run.stream_end(Role.MD, "failed:unavailable")
    assert run.trace.reason is FailReason.MD_LOST and run.trace.reason_text == "md_lost: failed:unavailable"


def test_failed_takeover_counts_as_md_lost() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4])
    run.stream_end(Role.RLD, "failed:unavailable")  # RLD lost: MD takes over
    out = run.feed(TakeoverFailed("r", "unavailable"))
    assert FallbackTaken(Fallback.MD_LOST_P_RLD) in out


def test_legs_are_bounded() -> None:
    """MD unreachable -> a leg on RLD; RLD lost while marked down -> a leg P->MD; and so on, until
    ``MAX_LEGS``: the next loss fails the request."""
    run = Run(Pipeline.P_MD)
    while run.m.state is RunState.RUNNING:
        leg = run.m.leg
        assert leg is not None
        if leg.pipeline is Pipeline.P_MD:
            run.rld_usable = True
            run.prefill(leg.sid, md_ok=False)
        else:
            run.rld_usable = False
            run.prefill(leg.sid)
            run.stream_end(Role.RLD, "failed:unavailable", sid=leg.sid)
    assert run.m.legs == MAX_LEGS and len(run.of(SendPrefill)) == MAX_LEGS
    assert run.trace.reason is FailReason.RLD_LOST and len(run.trace.fallbacks) == MAX_LEGS - 1


# -- RLD unreachable / lost -----------------------------------------------------------------------


def test_rld_gone_before_streaming_md_takes_over_from_p_first_token() -> None:
    run = Run(Pipeline.P_RLD_MD)
    out = run.prefill(rld_ok=False, rld_error="fast path refused")
    assert FallbackTaken(Fallback.RLD_UNREACHABLE_MD_TAKES_OVER) in out and CancelStreams(Role.RLD) in out
    assert ReleaseRldSlot() in out
    (take,) = [c for c in out if isinstance(c, TakeOver)]
    assert take.first_position == BASE and take.token_ids == (tok(BASE),) and take.emit_given
    run.tokens(Role.MD, range(BASE, BASE + 6))
    assert run.exact() and run.trace.rld_suspect


def test_rld_gone_on_a_singular_request_fails() -> None:
    run = Run(Pipeline.SINGULAR, max_tokens=3)
    run.prefill(rld_ok=False, rld_error="no route")
    assert (
        run.trace.reason is FailReason.RLD_UNREACHABLE
        and run.trace.reason_text == "rld_unreachable: no route"
    )


def test_rld_lost_during_streaming_md_takes_over_from_the_streamed_tokens() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5, 6])
    out = run.stream_end(Role.RLD, "failed:unavailable")
    assert FallbackTaken(Fallback.RLD_LOST_MD_TAKES_OVER) in out and ReleaseRldSlot() in out
    (take,) = [c for c in out if isinstance(c, TakeOver)]
    assert take.token_ids == (tok(4), tok(5), tok(6)) and not take.emit_given
    run.tokens(Role.MD, [7, 8, 9])
    assert run.exact() and run.trace.rld_suspect


def test_rld_lost_before_p_replied_waits_for_p_then_md_takes_over() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.tokens(Role.RLD, [4])
    assert run.stream_end(Role.RLD, "failed:unavailable") == [ReleaseRldSlot()]
    out = run.prefill()
    assert FallbackTaken(Fallback.RLD_UNREACHABLE_MD_TAKES_OVER) in out
    assert any(isinstance(c, TakeOver) for c in out) and run.of(StartHandoff) == []


def test_rld_lost_on_singular_reruns_p_md_when_rld_is_marked_down() -> None:
    run = Run(Pipeline.SINGULAR, max_tokens=3)
    run.prefill()
    run.tokens(Role.RLD, [4])
    run.rld_usable = False
    out = run.stream_end(Role.RLD, "failed:unavailable")
    assert FallbackTaken(Fallback.RLD_LOST_P_MD) in out
    assert run.m.leg is not None and run.m.leg.pipeline is Pipeline.P_MD and run.m.leg.sid == "r#2"


def test_rld_lost_on_singular_fails_while_rld_is_usable() -> None:
    run = Run(Pipeline.SINGULAR, max_tokens=3)
    run.prefill()
    run.stream_end(Role.RLD, "failed:unavailable")
    assert run.trace.reason is FailReason.RLD_LOST and run.trace.reason_text == "rld_lost: failed:unavailable"


# -- handoff --------------------------------------------------------------------------------------


def test_handoff_timeout_lets_rld_finish_and_drops_md() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5])
    out = run.handoff("failed:DEADLINE_EXCEEDED")
    assert FallbackTaken(Fallback.HANDOFF_FAILED_RLD_FINISHES) in out and CancelStreams(Role.MD) in out
    run.tokens(Role.RLD, [6, 7, 8, 9])
    assert run.exact() and run.trace.to_dict()["handoff_outcome"] == "failed:DEADLINE_EXCEEDED"


def test_rld_finishing_first_releases_md_without_a_fallback() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5])
    out = run.handoff("finished_on_rld")
    assert CancelStreams(Role.MD) in out and run.of(FallbackTaken) == []


def test_p_rld_md_that_finished_before_the_handoff_says_not_started() -> None:
    run = Run(Pipeline.P_RLD_MD, max_tokens=2)
    run.tokens(Role.RLD, [4, 5])
    assert run.trace.to_dict()["handoff_outcome"] == "not_started"


def test_rld_finishing_while_the_handoff_was_under_way_says_finished_on_rld() -> None:
    """StartHandoff went out (P replied: MD holds the KV) and RLD made the last token before its
    answer came back (a catch-up's last slice not yet due): RLD finished it, the handoff had begun."""
    run = Run(Pipeline.P_RLD_MD, max_tokens=4)
    assert StartHandoff("r") in run.prefill()
    run.tokens(Role.RLD, [4, 5, 6, 7])
    assert run.exact() and run.trace.to_dict()["handoff_outcome"] == "finished_on_rld"


# -- P, deadline -----------------------------------------------------------------------------------


def test_p_unavailable_fails() -> None:
    run = Run(Pipeline.P_MD)
    run.feed(PrefillFailed("r", "unavailable: connection refused"))
    assert run.trace.reason is FailReason.P_UNAVAILABLE
    assert run.of(RunEnded) == [RunEnded(RunOutcome.FAILED)]


def test_deadline_fails_the_run_at_its_timer_and_not_before() -> None:
    run = Run(Pipeline.P_RLD_MD, deadline_s=5.0)
    run.prefill()
    run.tokens(Role.RLD, [4])
    assert run.m.get_timer() == pytest.approx(105.0)
    assert run.timer(104.99) == []
    out = run.timer(105.0)
    assert ReleaseRldSlot() in out and out[-1] == RunEnded(RunOutcome.FAILED)
    assert run.trace.reason is FailReason.DEADLINE_EXCEEDED and run.trace.e2e_s == pytest.approx(5.0)


def test_p_md_waits_briefly_for_p_reply_after_md_finished() -> None:
    run = Run(Pipeline.P_MD, max_tokens=2)
    run.tokens(Role.MD, [4, 5])
    assert run.m.state is RunState.AWAITING_P_REPLY and run.of(RunEnded) == []
    assert run.m.get_timer() == pytest.approx(run.now + 1.0)
    run.prefill(wan_seconds=0.3)
    assert run.trace.outcome is RunOutcome.FINISHED and run.trace.to_dict()["wan_seconds"] == 0.3


def test_p_md_grace_for_p_reply_ends_finished_at_its_timer() -> None:
    run = Run(Pipeline.P_MD, max_tokens=2)
    run.tokens(Role.MD, [4, 5])
    run.timer(run.m.get_timer())  # type: ignore[arg-type]
    assert run.trace.outcome is RunOutcome.FINISHED and "wan_seconds" not in run.trace.to_dict()


# -- the table: every row is needed ----------------------------------------------------------------


def _md_unreachable_rld_finishes() -> Run:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill(md_ok=False)
    return run


def _md_unreachable_p_rld() -> Run:
    run = Run(Pipeline.P_MD)
    run.prefill(md_ok=False)
    return run


def _rld_unreachable() -> Run:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill(rld_ok=False)
    return run


def _md_congested_rld_finishes() -> Run:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill(md_ok=False, md_error="deadline_exceeded: transfer missed its deadline")
    return run


def _md_congested_p_rld() -> Run:
    run = Run(Pipeline.P_MD)
    run.prefill(md_ok=False, md_error="deadline_exceeded: transfer missed its deadline")
    return run


def _md_stalled_rld_finishes() -> Run:
    run = Run(Pipeline.P_RLD_MD)  # catch-up: MD streams too before RLD reports the handoff done
    run.prefill()
    run.tokens(Role.RLD, [4])
    run.tokens(Role.MD, [5])
    run.timer(run.now + run.m.spec.md_stall_s)
    return run


def _md_stalled_p_rld() -> Run:
    run = Run(Pipeline.P_MD)
    run.prefill()
    run.tokens(Role.MD, [4])
    run.timer(run.now + run.m.spec.md_stall_s)
    return run


def _md_lost_other_md() -> Run:
    run = Run(Pipeline.P_RLD_MD, spares=frozenset({Role.MD}))
    run.prefill()
    run.tokens(Role.RLD, [4])
    run.stream_end(Role.MD, "failed:unavailable")
    return run


def _md_unreachable_other_md() -> Run:
    run = Run(Pipeline.P_RLD_MD, spares=frozenset({Role.MD}))
    run.prefill(md_ok=False)
    return run


def _md_stalled_other_md() -> Run:
    run = Run(Pipeline.P_MD, spares=frozenset({Role.MD}))
    run.prefill()
    run.tokens(Role.MD, [4])
    run.timer(run.now + run.m.spec.md_stall_s)
    return run


def _p_lost_other_p() -> Run:
    run = Run(Pipeline.P_MD, spares=frozenset({Role.P}))
    run.feed(PrefillFailed("r", "unavailable: connection reset"))
    return run


SCENARIOS: dict[Fallback, Callable[[], Run]] = {
    Fallback.MD_LOST_OTHER_MD: _md_lost_other_md,
    Fallback.MD_UNREACHABLE_OTHER_MD: _md_unreachable_other_md,
    Fallback.MD_STALLED_OTHER_MD: _md_stalled_other_md,
    Fallback.P_LOST_OTHER_P: _p_lost_other_p,
    Fallback.MD_STALLED_RLD_FINISHES: _md_stalled_rld_finishes,
    Fallback.MD_STALLED_P_RLD: _md_stalled_p_rld,
    Fallback.MD_UNREACHABLE_RLD_FINISHES: _md_unreachable_rld_finishes,
    Fallback.MD_UNREACHABLE_P_RLD: _md_unreachable_p_rld,
    Fallback.MD_CONGESTED_RLD_FINISHES: _md_congested_rld_finishes,
    Fallback.MD_CONGESTED_P_RLD: _md_congested_p_rld,
    Fallback.RLD_UNREACHABLE_MD_TAKES_OVER: _rld_unreachable,
}


def _scenario(fallback: Fallback) -> Run:
    if fallback in SCENARIOS:
        return SCENARIOS[fallback]()
    run = Run(Pipeline.SINGULAR if fallback is Fallback.RLD_LOST_P_MD else Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4])
    if fallback is Fallback.RLD_LOST_MD_TAKES_OVER:
        run.stream_end(Role.RLD, "failed:unavailable")
    elif fallback is Fallback.RLD_LOST_P_MD:
        run.rld_usable = False
        run.stream_end(Role.RLD, "failed:unavailable")
    elif fallback is Fallback.MD_LOST_RLD_FINISHES:
        run.stream_end(Role.MD, "failed:unavailable")
    elif fallback is Fallback.MD_LOST_P_RLD:
        run.handoff("handed_off")
        run.stream_end(Role.RLD, "handed_off")
        run.stream_end(Role.MD, "failed:unavailable")
    return run


TABLE_ROWS = [
    (loss, i, fallback)
    for loss, rows in fallback_table.TABLE.items()
    for i, (_, fallback, _) in enumerate(rows)
    if fallback is not None
]


@pytest.mark.parametrize(("loss", "index", "fallback"), TABLE_ROWS, ids=[f.value for _, _, f in TABLE_ROWS])
def test_each_table_row_is_what_its_scenario_takes(
    loss: fallback_table.Loss, index: int, fallback: Fallback, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert fallback in _scenario(fallback).m.notes.fallbacks
    rows = list(fallback_table.TABLE[loss])
    del rows[index]
    monkeypatch.setitem(fallback_table.TABLE, loss, tuple(rows))
    assert fallback not in _scenario(fallback).m.notes.fallbacks


def test_the_wait_for_p_row_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    def scenario() -> list[Fallback]:
        run = Run(Pipeline.P_RLD_MD)
        run.stream_end(Role.RLD, "failed:unavailable")
        run.prefill()
        return run.m.notes.fallbacks

    assert scenario() == [Fallback.RLD_UNREACHABLE_MD_TAKES_OVER]
    rows = [
        r
        for r in fallback_table.TABLE[fallback_table.Loss.RLD_LOST]
        if r[2] is not fallback_table.Recovery.WAIT_FOR_P
    ]
    monkeypatch.setitem(fallback_table.TABLE, fallback_table.Loss.RLD_LOST, tuple(rows))
    assert scenario() != [Fallback.RLD_UNREACHABLE_MD_TAKES_OVER]
