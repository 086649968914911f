"""A run in a pool (issue 26): a lost MD or P is re-placed within its role (``MoveOff``, then a
new leg from the merged position on) when the router has another instance of it in placement; the
request still ends with every position once, each the one-engine token. Without a spare instance
nothing changes (the single-instance table)."""

from __future__ import annotations

from _run_harness import BASE, Run

from pddlink.lifecycle import (
    CancelStreams,
    DetachHandoff,
    Fallback,
    MoveOff,
    OpenStream,
    PrefillFailed,
    ReleaseRldSlot,
    RunOutcome,
    SendPrefill,
)
from pddlink.lifecycle.outcomes import FailReason
from pddlink.roles import Role
from pddlink.routing import Pipeline

MD_SPARE = frozenset({Role.MD})
P_SPARE = frozenset({Role.P})


def _after(run: Run, kind: type) -> list[object]:
    """Commands of ``kind`` given after the last ``MoveOff``."""
    moves = [i for i, c in enumerate(run.log) if isinstance(c, MoveOff)]
    assert moves, "no MoveOff"
    return [c for c in run.log[moves[-1] :] if isinstance(c, kind)]


def test_md_lost_mid_stream_moves_to_another_md_and_finishes_there_exactly() -> None:
    run = Run(Pipeline.P_MD, spares=MD_SPARE)
    run.prefill()
    run.tokens(Role.MD, [4, 5])
    out = run.stream_end(Role.MD, "failed:unavailable")
    assert MoveOff(Role.MD) in out
    assert out.index(MoveOff(Role.MD)) < next(i for i, c in enumerate(out) if isinstance(c, OpenStream))
    [opened] = _after(run, OpenStream)
    assert isinstance(opened, OpenStream) and opened.on is Role.MD and opened.leg.sid == "r#2"
    assert opened.leg.prompt[BASE:] == (run.emitted()[0][1], run.emitted()[1][1])  # from the merged position
    [sent] = _after(run, SendPrefill)
    assert isinstance(sent, SendPrefill) and sent.ship_to_md and not sent.ship_to_rld
    run.prefill("r#2")
    run.tokens(Role.MD, [6, 7, 8, 9], sid="r#2")
    run.prefill("r#2")
    assert run.trace.outcome is RunOutcome.FINISHED and run.exact()
    assert run.trace.fallbacks == (Fallback.MD_LOST_OTHER_MD,)


def test_md_lost_while_rld_streams_moves_to_another_md_and_releases_rld() -> None:
    run = Run(Pipeline.P_RLD_MD, spares=MD_SPARE)
    run.prefill()
    run.tokens(Role.RLD, [4])
    out = run.stream_end(Role.MD, "failed:unavailable")
    assert CancelStreams(Role.RLD) in out and ReleaseRldSlot() in out and DetachHandoff() in out
    [opened] = _after(run, OpenStream)
    assert isinstance(opened, OpenStream) and opened.on is Role.MD and opened.leg.pipeline is Pipeline.P_MD
    run.stream_end(Role.RLD, "released")  # the old leg's RLD answers the cancel: ignored
    run.prefill("r#2")
    run.tokens(Role.MD, [5, 6, 7, 8, 9], sid="r#2")
    assert run.trace.outcome is RunOutcome.FINISHED and run.exact()
    assert dict(run.trace.tokens) == {"rld": 1, "md": 5}


def test_md_unreachable_in_p_reply_moves_to_another_md() -> None:
    run = Run(Pipeline.P_MD, spares=MD_SPARE)
    out = run.prefill(md_ok=False, md_error="unavailable: connection refused")
    assert MoveOff(Role.MD) in out
    assert run.m.notes.fallbacks == [Fallback.MD_UNREACHABLE_OTHER_MD]


def test_md_stalled_while_rld_streams_moves_to_another_md_with_a_spare_and_rld_finishes_without() -> None:
    def stalled(spares: frozenset[Role]) -> Run:
        run = Run(Pipeline.P_RLD_MD, spares=spares)
        run.prefill()
        run.tokens(Role.RLD, [4])
        run.tokens(Role.MD, [5])
        run.timer(run.now + run.m.spec.md_stall_s)
        return run

    moved = stalled(MD_SPARE)
    assert moved.m.notes.fallbacks == [Fallback.MD_STALLED_OTHER_MD] and moved.of(MoveOff)
    assert CancelStreams(Role.RLD) in moved.log
    alone = stalled(frozenset())
    assert alone.m.notes.fallbacks == [Fallback.MD_STALLED_RLD_FINISHES] and not alone.of(MoveOff)


def test_p_lost_before_its_reply_moves_to_another_p_with_the_same_pipeline() -> None:
    run = Run(Pipeline.P_RLD_MD, spares=P_SPARE)
    out = run.feed(PrefillFailed("r", "unavailable: connection reset"))
    assert CancelStreams(Role.MD) in out and CancelStreams(Role.RLD) in out
    assert out.index(MoveOff(Role.P)) < out.index(next(c for c in out if isinstance(c, SendPrefill)))
    opened = _after(run, OpenStream)
    assert {c.on for c in opened if isinstance(c, OpenStream)} == {Role.MD, Role.RLD}
    run.prefill("r#2")
    run.tokens(Role.RLD, range(4, 10), sid="r#2")
    assert run.trace.outcome is RunOutcome.FINISHED and run.exact()
    assert run.trace.fallbacks == (Fallback.P_LOST_OTHER_P,)


def test_p_lost_without_a_spare_fails_as_p_unavailable() -> None:
    run = Run(Pipeline.P_MD, spares=MD_SPARE)  # another MD does not help a lost P
    run.feed(PrefillFailed("r", "unavailable: connection reset"))
    assert run.trace.reason is FailReason.P_UNAVAILABLE and not run.of(MoveOff)


def test_moves_are_bounded_by_the_legs() -> None:
    run = Run(Pipeline.P_MD, spares=P_SPARE | MD_SPARE)
    for leg in range(1, 5):
        run.feed(PrefillFailed("r" if leg == 1 else f"r#{leg}", "unavailable"))
    assert len(run.of(MoveOff)) == 3
    assert run.trace.outcome is RunOutcome.FAILED and run.trace.reason is FailReason.P_UNAVAILABLE
