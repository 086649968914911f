"""MD stall detection in the router's run machine, in memory on an injected clock (no processes).

An MD whose stream stays open but stops producing tokens (a stopped engine, a black-holed WAN) must
be noticed: once MD owes the request tokens, no token for ``RunSpec.md_stall_s`` is a stall; the
run cancels MD's stream, says ``MdStalled`` (the router keeps new requests off MD), and reruns the
rest on RLD while P holds the KV, or fails ``md_stalled`` -- in either case before its deadline.
Before this, such a run waited for its deadline and failed ``deadline_exceeded`` (issue 16, 4).
"""

from __future__ import annotations

from _run_harness import BASE, Run

from pddlink.lifecycle import (
    CancelStreams,
    FailReason,
    Fallback,
    MdStalled,
    MdSuspected,
    OpenStream,
    RunOutcome,
    SendPrefill,
    md_stall_bound,
)
from pddlink.lifecycle.stall import COOL_DOWN_MAX_S, COOL_DOWN_S, MD_STALL_MIN_S, SUSPECT_S, StallBreaker
from pddlink.roles import Role
from pddlink.routing import Option, Pipeline


def test_md_silent_after_its_tokens_is_a_stall_at_the_bound_and_rld_finishes() -> None:
    run = Run(Pipeline.P_MD, max_tokens=6)
    bound = run.m.spec.md_stall_s
    run.prefill()
    run.tokens(Role.MD, [4, 5])
    last = run.now
    assert run.m.get_timer() == last + bound  # the stall timer, not the deadline
    assert run.timer(last + bound - 0.01) == []  # not before the bound
    out = run.timer(last + bound)
    assert MdStalled(bound) in out
    assert CancelStreams(Role.MD) in out
    legs = [c for c in out if isinstance(c, OpenStream)]
    assert len(legs) == 1 and legs[0].on is Role.RLD and legs[0].leg.pipeline is Pipeline.SINGULAR
    assert legs[0].leg.prompt[BASE:] == (1004, 1005)  # from the merged position on
    (send,) = [c for c in out if isinstance(c, SendPrefill)]
    assert send.ship_to_rld and not send.ship_to_md
    run.prefill(sid="r#2")
    run.tokens(Role.RLD, range(BASE + 2, BASE + 6), sid="r#2")
    assert run.exact() and run.trace.outcome is RunOutcome.FINISHED
    assert run.trace.fallbacks == (Fallback.MD_STALLED_P_RLD,)
    assert run.trace.e2e_s < run.m.spec.deadline_s


def test_every_token_from_md_pushes_the_stall_back() -> None:
    run = Run(Pipeline.P_MD, max_tokens=8, deadline_s=30.0)
    bound = run.m.spec.md_stall_s
    run.prefill()
    for p in range(BASE, BASE + 7):  # slow but steady: a token every 0.9 x the bound
        run.now += 0.9 * bound - 0.01
        assert run.timer(run.now) == []
        run.tokens(Role.MD, [p])
    run.tokens(Role.MD, [BASE + 7])
    assert run.trace.outcome is RunOutcome.FINISHED and run.trace.fallbacks == ()


def test_md_stalled_without_rld_fails_md_stalled_before_the_deadline() -> None:
    run = Run(Pipeline.P_MD, rld_usable=False)
    run.prefill()
    run.tokens(Role.MD, [4])
    out = run.timer(run.now + run.m.spec.md_stall_s)
    assert any(isinstance(c, MdStalled) for c in out)
    assert run.trace.outcome is RunOutcome.FAILED and run.trace.reason is FailReason.MD_STALLED
    assert run.trace.reason_text.startswith("md_stalled: no token from MD for")
    assert run.trace.e2e_s < run.m.spec.deadline_s


def test_md_that_never_starts_after_p_shipped_the_kv_stalls() -> None:
    run = Run(Pipeline.P_MD)
    run.prefill()  # MD holds the KV: its first token is due
    out = run.timer(run.now + run.m.spec.md_stall_s)
    assert any(isinstance(c, MdStalled) for c in out)
    assert Fallback.MD_STALLED_P_RLD in run.m.notes.fallbacks


def test_md_owes_nothing_before_p_replied_or_before_the_handoff() -> None:
    run = Run(Pipeline.P_MD)  # the KV is still on the WAN: P's reply (or the deadline) decides
    assert run.m.get_timer() == run.m.deadline
    relay = Run(Pipeline.P_RLD_MD)
    relay.prefill()
    relay.tokens(Role.RLD, [4, 5])  # RLD streams; MD waits for the handoff
    assert relay.m.get_timer() == relay.m.deadline


def test_md_silent_after_the_handoff_stalls_and_the_rest_runs_on_rld() -> None:
    run = Run(Pipeline.P_RLD_MD)
    run.prefill()
    run.tokens(Role.RLD, [4, 5])
    run.handoff("handed_off")
    run.stream_end(Role.RLD, "handed_off")
    out = run.timer(run.now + run.m.spec.md_stall_s)
    assert any(isinstance(c, MdStalled) for c in out)
    assert run.m.notes.fallbacks == [Fallback.MD_STALLED_P_RLD]


def test_a_recomputing_md_owes_tokens_only_once_it_is_ready() -> None:
    run = Run(Pipeline.P_MD, option=Option.RECOMPUTE)
    run.prefill(md_ok=False)  # P ships nothing; MD is prefilling itself, which may take long
    assert run.timer(run.now + 3 * run.m.spec.md_stall_s) == []
    run.md_ready()
    out = run.timer(run.now + run.m.spec.md_stall_s)
    assert any(isinstance(c, MdStalled) for c in out)


def test_a_finished_md_stream_disarms_the_watch() -> None:
    run = Run(Pipeline.P_MD)
    run.prefill()
    run.tokens(Role.MD, range(BASE, BASE + 6))
    assert run.trace.outcome is RunOutcome.FINISHED and run.m.get_timer() is None


def test_the_bound_comes_from_the_link_estimate_and_mds_token_time() -> None:
    assert md_stall_bound(0.02, 0.01) == MD_STALL_MIN_S  # a fast line: the floor
    assert md_stall_bound(0.5, 0.01) == 8 * 0.5 + 32 * 0.01  # a long RTT stretches it
    assert md_stall_bound(0.02, 0.2) > md_stall_bound(0.02, 0.01)


def test_the_breaker_keeps_new_requests_off_md_until_it_is_healthy_again() -> None:
    b = StallBreaker()
    assert b.usable(0.0)
    b.stalled(10.0)
    assert not b.usable(10.0 + COOL_DOWN_S - 0.01) and b.usable(10.0 + COOL_DOWN_S)
    b.stalled(10.0 + COOL_DOWN_S + 0.5)  # the first request after the cool-down stalls again
    assert b.cool_s == 2 * COOL_DOWN_S and not b.usable(10.0 + 2 * COOL_DOWN_S + 0.5)
    for _ in range(10):
        b.stalled(b.down_until + 0.1)
    assert b.cool_s == COOL_DOWN_MAX_S  # bounded
    t = b.down_until - 1.0
    b.healthy()  # a request got tokens from MD without a stall
    assert b.cool_s == COOL_DOWN_S and b.usable(t)
    b.stalled(t)
    assert b.down_until == t + COOL_DOWN_S


def test_a_trace_says_whether_md_streamed_without_a_stall() -> None:
    ok = Run(Pipeline.P_MD)
    ok.prefill()
    ok.tokens(Role.MD, range(BASE, BASE + 6))
    assert ok.trace.md_streamed
    stalled = Run(Pipeline.P_MD)
    stalled.prefill()
    stalled.tokens(Role.MD, [4])
    stalled.timer(stalled.now + stalled.m.spec.md_stall_s)
    stalled.prefill(sid="r#2")
    stalled.tokens(Role.RLD, range(BASE + 1, BASE + 6), sid="r#2")
    assert stalled.trace.outcome is RunOutcome.FINISHED and not stalled.trace.md_streamed


def test_a_suspected_md_silent_for_the_short_bound_stalls_at_once_and_says_nothing_more() -> None:
    """A WAN outage silences every MD stream at once: after one run's stall the router suspects MD
    in the others, and each one silent for ``SUSPECT_S`` moves to RLD now, not a full bound later
    (issue 16, chaos: requests streaming from MD when a long outage began lost 2 s each)."""
    run = Run(Pipeline.P_MD, max_tokens=6)
    assert run.m.spec.md_stall_s > SUSPECT_S
    run.prefill()
    run.tokens(Role.MD, [4, 5])
    run.now += SUSPECT_S  # silent this long: not yet a stall on its own bound
    assert run.timer(run.now) == []
    out = run.feed(MdSuspected(), dt=0.0)
    assert CancelStreams(Role.MD) in out and not any(isinstance(c, MdStalled) for c in out)
    assert Fallback.MD_STALLED_P_RLD in run.m.notes.fallbacks
    assert any(isinstance(c, OpenStream) and c.on is Role.RLD for c in out)


def test_a_suspected_md_that_streams_is_kept_and_its_next_token_ends_the_suspicion() -> None:
    run = Run(Pipeline.P_MD, max_tokens=8, deadline_s=30.0)
    bound = run.m.spec.md_stall_s
    run.prefill()
    run.tokens(Role.MD, [4])
    assert run.feed(MdSuspected(), dt=0.05) == []  # it streamed 0.05 s ago: alive
    assert run.m.get_timer() == run.now - 0.05 + SUSPECT_S  # a short silence would stall now
    run.now += 0.1
    run.tokens(Role.MD, [5])  # a token: the suspicion ends
    assert run.m.get_timer() == run.now + bound
    run.now += SUSPECT_S + 0.1
    assert run.timer(run.now) == []  # silent past SUSPECT_S, within the bound: still fine
    run.tokens(Role.MD, [6, 7, 8, 9, 10, 11])
    assert run.trace.outcome is RunOutcome.FINISHED and run.trace.fallbacks == ()


def test_a_suspicion_before_md_owes_anything_changes_nothing() -> None:
    run = Run(Pipeline.P_MD)
    assert run.feed(MdSuspected()) == []  # P has not replied: MD owes no token yet
    run.prefill()
    assert run.m.get_timer() == run.now + run.m.spec.md_stall_s
