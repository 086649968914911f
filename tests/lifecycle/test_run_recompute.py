"""Ship or recompute in the router's run machine, in memory on an injected clock (no processes).

A recomputing first leg sends no KV to MD (MD prefills the prompt itself and says ``ready``); on
relay + recompute RLD hands over only once MD is ready, and a ready that does not come before the
deadline's margin lets RLD finish (``md_recompute_late``); a WAN transfer that lost to its deadline
is congestion, not an unreachable MD (the ``wan_congested`` rows of the fallback table).
"""

from __future__ import annotations

from _run_harness import BASE, Run

from pddlink.lifecycle import (
    CancelStreams,
    FailReason,
    Fallback,
    FallbackTaken,
    HandoffOutcome,
    OpenStream,
    RunOutcome,
    SendPrefill,
    StartHandoff,
)
from pddlink.lifecycle.run import HANDOFF_MARGIN_S
from pddlink.roles import Role
from pddlink.routing import Option, Pipeline, RecomputeMode

CONGESTED = "deadline_exceeded: transfer missed its deadline: 0/2 chunks acknowledged"


def test_a_recompute_leg_sends_no_kv_to_md_and_md_streams_alone() -> None:
    run = Run(Pipeline.P_MD, option=Option.RECOMPUTE)
    leg = run.m.leg
    assert leg is not None and leg.recompute is RecomputeMode.AND_DECODE
    assert OpenStream(Role.MD, leg) in run.log
    (send,) = run.of(SendPrefill)
    assert isinstance(send, SendPrefill)
    assert not send.ship_to_md and not send.first_token_to_md and not send.ship_to_rld
    run.md_ready(cached=2, recompute_s=0.07)
    run.tokens(Role.MD, range(BASE, BASE + 6))  # MD finishes before P's reply: no wait for it
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED
    d = run.trace.to_dict()
    assert d["md_recompute_s"] == 0.07 and d["md_cached_tokens"] == 2


def test_p_reply_without_md_shipment_is_no_loss_on_a_recompute_leg() -> None:
    run = Run(Pipeline.P_MD, option=Option.RECOMPUTE)
    out = run.prefill(md_ok=False, md_cached_tokens=9)  # P shipped nothing: not a failed shipment
    assert not [c for c in out if isinstance(c, FallbackTaken | CancelStreams)]
    run.md_ready(cached=3)
    run.tokens(Role.MD, range(BASE, BASE + 6))
    assert run.trace.outcome is RunOutcome.FINISHED and run.trace.fallbacks == ()
    assert run.trace.to_dict()["md_cached_tokens"] == 3  # MD's own figure, not P's report


def test_relay_recompute_starts_the_handoff_only_once_md_is_ready() -> None:
    run = Run(Pipeline.P_RLD_MD, option=Option.RELAY_RECOMPUTE)
    (send,) = run.of(SendPrefill)
    assert isinstance(send, SendPrefill) and not send.ship_to_md and send.ship_to_rld
    run.tokens(Role.RLD, [4, 5])
    assert run.prefill(md_ok=False) == [] and run.of(StartHandoff) == []
    assert run.m.get_timer() == run.m.deadline - HANDOFF_MARGIN_S
    assert run.md_ready() == [StartHandoff("r")]
    run.handoff("handed_off")
    run.stream_end(Role.RLD, "handed_off")
    run.tokens(Role.MD, [6, 7, 8, 9])
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED and run.trace.fallbacks == ()


def test_md_ready_before_p_reply_hands_off_at_p_reply() -> None:
    run = Run(Pipeline.P_RLD_MD, option=Option.RELAY_RECOMPUTE)
    run.tokens(Role.RLD, [4])
    assert run.md_ready() == []
    assert StartHandoff("r") in run.prefill(md_ok=False)


def test_md_recompute_late_takes_the_handoff_failed_row_and_rld_finishes() -> None:
    run = Run(Pipeline.P_RLD_MD, option=Option.RELAY_RECOMPUTE)
    run.tokens(Role.RLD, [4, 5])
    run.prefill(md_ok=False)
    out = run.timer(run.m.deadline - HANDOFF_MARGIN_S)
    assert FallbackTaken(Fallback.HANDOFF_FAILED_RLD_FINISHES) in out and CancelStreams(Role.MD) in out
    assert run.m.trace is None and run.of(StartHandoff) == []  # the run goes on: RLD finishes it
    assert run.md_ready() == []  # too late now: no handoff
    run.tokens(Role.RLD, [6, 7, 8, 9])
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED
    assert run.trace.handoff is not None and run.trace.handoff.outcome is HandoffOutcome.FAILED
    assert run.trace.handoff.detail == "md_recompute_late"


def test_a_fallback_leg_does_not_recompute() -> None:
    run = Run(Pipeline.P_MD, option=Option.RECOMPUTE)
    run.md_ready()
    run.tokens(Role.MD, [4])
    out = run.stream_end(Role.MD, "failed:unavailable")  # MD lost: the rest reruns on RLD
    assert FallbackTaken(Fallback.MD_LOST_P_RLD) in out
    leg = run.m.leg
    assert leg is not None and leg.sid == "r#2" and leg.recompute is RecomputeMode.NONE
    sends = [c for c in out if isinstance(c, SendPrefill)]
    assert len(sends) == 1 and sends[0].ship_to_rld and not sends[0].ship_to_md


def test_congestion_on_the_relayed_path_takes_the_wan_congested_row() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.tokens(Role.RLD, [4, 5])
    out = run.prefill(md_ok=False, md_error=CONGESTED)
    assert FallbackTaken(Fallback.MD_CONGESTED_RLD_FINISHES) in out
    assert FallbackTaken(Fallback.MD_UNREACHABLE_RLD_FINISHES) not in out
    run.tokens(Role.RLD, [6, 7, 8, 9])
    assert run.exact() and run.trace.fallbacks == (Fallback.MD_CONGESTED_RLD_FINISHES,)


def test_congestion_on_p_md_reruns_on_rld_and_without_rld_fails_as_congested() -> None:
    run = Run(Pipeline.P_MD)
    out = run.prefill(md_ok=False, md_error=CONGESTED)
    assert FallbackTaken(Fallback.MD_CONGESTED_P_RLD) in out
    leg = run.m.leg
    assert leg is not None and leg.pipeline is Pipeline.SINGULAR
    alone = Run(Pipeline.P_MD, rld_usable=False)
    alone.prefill(md_ok=False, md_error=CONGESTED)
    assert alone.trace.reason is FailReason.MD_CONGESTED
    assert alone.trace.reason_text == f"wan_congested: {CONGESTED}"
