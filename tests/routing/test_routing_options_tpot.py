"""Ship or recompute under a decode-speed bound: what recompute costs the requests MD is decoding
(blocking or chunked prefill), this request's own TPOT, and the typed rejection when only breaking
the bound would meet the deadlines."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.errors import ConfigError
from pddlink.routing import (
    LinkEstimate,
    MdPrefill,
    MdRun,
    Option,
    OptionInputs,
    RejectReason,
    RoutingPolicy,
    choose_option,
    estimate_options,
)
from pddlink.routing.decode_bound import (
    MAX_HOLD_S,
    PUSHED_OVER_LIMIT,
    PUSHED_OVER_LIMIT_WITHOUT_RELAY,
    RESERVED_SHARE_OF_BOUND,
    expected_pushed_over,
    hold_for_short_runs,
    tpot_headroom_s,
)
from pddlink.routing.outputs import OutputBook, OutputLengths, missed_tpot
from tests.routing.test_routing_options import LINE, PDD_RECOMPUTE, option_inputs, policies, routing

BUSY = LinkEstimate(LINE, 0.02, flows_in_flight=10, backlog_bytes=40_000_000)
BOUND = 0.03
MD = MdPrefill(tokens_per_s=8000.0)  # 768 tokens: 96 ms of prefill


def overloaded(md: MdPrefill = MD, **kw: object) -> OptionInputs:
    base: dict[str, object] = dict(
        deadline_s=60.0, md_prefill=md, md_tpot_s=0.02, md_running=20, tpot_bound_s=BOUND
    )
    base.update(kw)
    return OptionInputs(routing(link=BUSY), **base)  # type: ignore[arg-type]


def test_blocking_recompute_on_a_busy_md_breaks_the_bound_so_it_relays() -> None:
    unbounded = choose_option(overloaded(tpot_bound_s=None), PDD_RECOMPUTE)
    assert unbounded.option is Option.RECOMPUTE
    d = choose_option(overloaded(), PDD_RECOMPUTE)
    assert d.option is Option.RELAY and d.admitted
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_batch_tpot_s == pytest.approx(0.02 + 768 / 8000)
    relay = d.estimate(Option.RELAY)
    assert relay is not None and relay.md_batch_tpot_s == 0.0 and relay.tpot_s <= BOUND


def test_chunked_prefill_within_the_headroom_recomputes_and_takes_longer() -> None:
    chunked = MdPrefill(
        tokens_per_s=8000.0, chunk_tokens=48
    )  # 6 ms per step: 26 ms <= 0.9 x 30 ms (the reserve)
    d = choose_option(overloaded(chunked), PDD_RECOMPUTE)
    assert d.option is Option.RELAY_RECOMPUTE  # MD ready in 0.43 s: past relay_min_wan_s, RLD streams
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_batch_tpot_s == pytest.approx(0.026)
    # 16 chunks, each alongside one 20 ms decode step, after the token ids' half round trip
    assert rec.md_ready_s == pytest.approx(0.01 + 768 / 8000 + 16 * 0.02)
    wide = MdPrefill(tokens_per_s=8000.0, chunk_tokens=256)  # 32 ms per step: breaks it
    assert choose_option(overloaded(wide), PDD_RECOMPUTE).option is Option.RELAY


def test_a_plan_at_the_bound_itself_is_not_taken() -> None:
    at_bound = MdPrefill(tokens_per_s=8000.0, chunk_tokens=80)  # 10 ms per step: exactly 30 ms
    d = choose_option(overloaded(at_bound), PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_batch_tpot_s == pytest.approx(BOUND)
    assert d.option is Option.RELAY and RESERVED_SHARE_OF_BOUND > 0


LONG = OutputLengths.of([100] * 50)  # every request lately produced 100 tokens


def test_a_stall_no_running_request_is_short_enough_to_feel_fits_unless_mds_queue_is_long() -> None:
    long_outputs = overloaded(md_outputs=LONG)  # 96 ms with 7 ms of slack: under 14 tokens only
    d = choose_option(long_outputs, PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert d.option is Option.RECOMPUTE and rec is not None and rec.md_pushed_over == 0.0
    assert rec.md_batch_tpot_s == pytest.approx(0.02 + 0.096 / 100)  # the token-weighted mean
    queued = overloaded(MdPrefill(8000.0, queue_s=2.0), md_outputs=LONG)  # 2.1 s: all 20 of them
    d = choose_option(queued, PDD_RECOMPUTE)
    assert d.option is not Option.RECOMPUTE and d.option is not Option.RELAY_RECOMPUTE
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_pushed_over == pytest.approx(20.0)


def test_the_share_of_running_requests_pushed_over_is_the_share_of_tokens_in_short_ones() -> None:
    lengths = OutputLengths.of([10] * 9 + [910])  # 90 tokens of 1000 in requests of 10 tokens
    assert lengths.token_share_below(11) == pytest.approx(0.09)
    assert lengths.token_share_below(10) == 0.0 and lengths.token_share_below(911) == 1.0
    assert lengths.token_weighted_mean() == pytest.approx((9 * 100 + 910**2) / 1000)
    assert OutputLengths().token_share_below(2) == 1.0 and OutputLengths().token_share_below(1) == 0.0
    # 96 ms of prefill against 7 ms of slack breaks requests under 13.7 tokens: 9% of the tokens
    d = choose_option(overloaded(md_outputs=lengths, md_running=1), PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_pushed_over == pytest.approx(0.09)
    assert d.option is Option.RELAY  # over PUSHED_OVER_LIMIT: RLD serves it without harming anyone
    rare = OutputLengths.of([10] * 9 + [5910])  # 90 tokens of 6000 in short requests: 1.5%
    d = choose_option(overloaded(md_outputs=rare, md_running=1), PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_pushed_over == pytest.approx(0.015)
    assert rec.md_pushed_over < PUSHED_OVER_LIMIT
    assert d.option is Option.RECOMPUTE
    d = choose_option(overloaded(md_outputs=rare, md_running=2), PDD_RECOMPUTE)
    assert d.option is Option.RELAY  # 0.03 expected


def test_a_running_request_bounded_shorter_than_a_stall_breaks_is_pushed_over_for_certain() -> None:
    """96 ms of prefill against 7 ms of headroom breaks requests under 13.7 tokens. Recent outputs
    hold 1.5% of their tokens in requests that short, so the share alone recomputes; a running
    request whose max_tokens is 8 ends that short whatever the share says."""
    rare = OutputLengths.of([10] * 9 + [5910])
    assert choose_option(overloaded(md_outputs=rare, md_running=1), PDD_RECOMPUTE).option is Option.RECOMPUTE
    d = choose_option(overloaded(md_outputs=rare, md_running=1, md_runs=(MdRun(8),)), PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_pushed_over == pytest.approx(1.0)
    assert d.option is Option.RELAY  # RLD serves it and the short request keeps its TPOT
    no_relay = replace(PDD_RECOMPUTE, relay_enabled=False)  # refusing it would trade one for one
    kept = choose_option(overloaded(md_outputs=rare, md_running=1, md_runs=(MdRun(8),)), no_relay)
    assert kept.option is Option.RECOMPUTE
    rec = kept.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_pushed_over == pytest.approx(0.015)  # the share's estimate
    long = overloaded(md_outputs=rare, md_running=1, md_runs=(MdRun(14),))  # not under 13.7
    assert choose_option(long, PDD_RECOMPUTE).option is Option.RECOMPUTE
    assert expected_pushed_over(3, (MdRun(8), MdRun(9), MdRun(500)), 13.7, rare) == pytest.approx(2.015)
    assert expected_pushed_over(1, (MdRun(8), MdRun(9)), 13.7, rare) == 1.0  # never more than MD runs
    assert expected_pushed_over(0, (MdRun(8),), 13.7, rare) == 0.0
    with pytest.raises(ConfigError):
        MdRun(0)
    with pytest.raises(ConfigError):
        MdRun(8, -1)


def test_a_recompute_holds_until_the_short_runs_it_would_push_over_end() -> None:
    """MD decodes at 4 ms against a 10 ms bound (5 ms of headroom): 96 ms of prefill breaks requests
    under 19.2 tokens. A run bounded at 8 tokens ends within 32 ms: the recompute waits that long
    and pushes nobody over for certain; one bounded at 30 is not pushed over; one at 18 (72 ms)
    still could be held, one at 19 with a 4 ms step beyond the 0.1 s limit could not."""
    r8, r18, r30, r500 = MdRun(8), MdRun(18), MdRun(30), MdRun(500)
    assert hold_for_short_runs((r8, r500), 19.2, 0.004) == (pytest.approx(0.032), (r500,))
    assert hold_for_short_runs((r8, r18, r30), 19.2, 0.004) == (pytest.approx(0.072), (r30,))
    assert hold_for_short_runs((r30, r500), 19.2, 0.004) == (0.0, (r30, r500))  # nobody pushed over
    assert hold_for_short_runs((MdRun(19),), 19.2, 0.006) == (0.0, (MdRun(19),))  # 114 ms: past MAX_HOLD_S
    assert hold_for_short_runs((MdRun(19, 5),), 19.2, 0.006) == (pytest.approx(0.084), ())  # 14 left
    assert 19 * 0.006 > MAX_HOLD_S >= 18 * 0.004
    rare = OutputLengths.of([10] * 9 + [5910])  # 1.5% of recent tokens in requests under 19.2
    short = replace(
        overloaded(
            md_outputs=rare, md_running=2, md_runs=(MdRun(8), MdRun(500)), md_tpot_s=0.004, tpot_bound_s=0.01
        ),
        routing=routing(link=BUSY, rld_tpot_s=0.005),  # RLD keeps the bound: runs known short count
    )
    d = choose_option(short, PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.hold_s == pytest.approx(0.032)
    assert rec.md_pushed_over == pytest.approx(0.015)  # the run of 500 by the share; the 8 ended
    assert rec.md_ready_s == pytest.approx(0.01 + 768 / 8000 + 0.032)
    assert d.option is Option.RECOMPUTE and d.hold_s == pytest.approx(0.032)
    relay_recompute = d.estimate(Option.RELAY_RECOMPUTE)  # RLD streams at once: nothing is held
    assert relay_recompute is not None and relay_recompute.hold_s == 0.0
    assert relay_recompute.md_pushed_over == pytest.approx(1.015)
    too_long = replace(short, md_runs=(MdRun(19), MdRun(500)), md_tpot_s=0.006)  # 114 ms to wait
    d = choose_option(too_long, PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.hold_s == 0.0 and rec.md_pushed_over >= 1.0
    assert d.option is not Option.RECOMPUTE and d.hold_s == 0.0
    no_relay = replace(PDD_RECOMPUTE, relay_enabled=False)  # the loose pass holds too
    d = choose_option(short, no_relay)
    assert d.option is Option.RECOMPUTE and d.hold_s == pytest.approx(0.032)
    unbounded = choose_option(replace(short, tpot_bound_s=None), PDD_RECOMPUTE)
    assert unbounded.hold_s == 0.0  # no bound, no stall to spare anyone


def test_a_run_still_in_mds_queue_is_held_for_past_the_queue() -> None:
    """A run that has produced nothing waits in MD's queue (50 ms of prefill) and then decodes its 8
    tokens: it ends 82 ms from now, so the router holds the recompute the 32 ms of that past the
    queue it waits behind anyway; a run already decoding with 4 tokens left ends before the queue
    does, and nothing is held for it."""
    queued = MdPrefill(8000.0, queue_s=0.05)
    assert hold_for_short_runs((MdRun(8),), 30.0, 0.004, queued.queue_s) == (pytest.approx(0.082), ())
    assert hold_for_short_runs((MdRun(8, 4),), 30.0, 0.004, queued.queue_s) == (pytest.approx(0.016), ())
    rare = OutputLengths.of([10] * 9 + [5910])
    base = replace(
        overloaded(queued, md_outputs=rare, md_running=1, md_tpot_s=0.004, tpot_bound_s=0.01),
        routing=routing(link=BUSY, rld_tpot_s=0.005),
    )
    plain = estimate_options(base, PDD_RECOMPUTE)
    for runs, extra in (((MdRun(8),), 0.032), ((MdRun(8, 4),), 0.0)):
        held = estimate_options(replace(base, md_runs=runs), PDD_RECOMPUTE)
        before = next(e for e in plain if e.option is Option.RECOMPUTE)
        after = next(e for e in held if e.option is Option.RECOMPUTE)
        assert after.hold_s == pytest.approx(extra)  # what the router waits: past the queue only
        assert after.md_ready_s == pytest.approx(before.md_ready_s + extra)
        assert after.md_pushed_over == pytest.approx(0.0)  # the short run has ended either way


def test_recompute_may_push_over_as_many_as_relays_lately_missed() -> None:
    """Recompute expected to push 0.045 of MD's runs over loses to a relay while relays keep the
    bound; once 1 relay in 10 lately missed it on RLD, recompute is the smaller harm."""
    rare = OutputLengths.of([10] * 9 + [5910])  # 1.5% of the tokens in requests that short
    three = overloaded(md_outputs=rare, md_running=3)
    assert choose_option(three, PDD_RECOMPUTE).option is Option.RELAY
    d = choose_option(replace(three, rld_miss_share=0.1), PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert d.option is Option.RECOMPUTE and rec is not None and rec.md_pushed_over == pytest.approx(0.045)
    assert choose_option(replace(three, rld_miss_share=0.04), PDD_RECOMPUTE).option is Option.RELAY
    with pytest.raises(ConfigError):
        replace(three, rld_miss_share=1.5)


def test_the_relay_miss_share_counts_relayed_requests_only_over_a_window() -> None:
    book = OutputBook()
    assert book.relay_miss_share() == 0.0
    book.add(100, 0, missed_tpot=True)  # not relayed: MD's own miss is charged by the bound itself
    assert book.relay_miss_share() == 0.0
    book.add(40, 40, missed_tpot=True)
    book.add(50, 10, missed_tpot=False)
    assert book.relay_miss_share() == pytest.approx(0.5)
    for _ in range(OutputBook.RELAY_WINDOW):
        book.add(20, 20)
    assert book.relay_miss_share() == 0.0  # the old miss has left the window


def test_an_idle_md_pushes_nobody_over_and_rides_no_decode_steps() -> None:
    chunked = MdPrefill(tokens_per_s=8000.0, chunk_tokens=48)
    d = choose_option(overloaded(chunked, md_running=0), PDD_RECOMPUTE)
    rec = d.estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_batch_tpot_s == pytest.approx(0.026)
    assert rec.md_ready_s == pytest.approx(0.01 + 768 / 8000)  # no decode steps to ride on
    assert d.option is Option.RECOMPUTE  # ready in 0.1 s: MD alone, sooner than relay_min_wan_s
    # blocking, 96 ms: nobody decodes on MD to be stalled; who joins meanwhile judges MD's queue itself
    blocking = choose_option(overloaded(md_running=0), PDD_RECOMPUTE)
    est = blocking.estimate(Option.RECOMPUTE)
    assert blocking.option is Option.RECOMPUTE and est is not None and est.md_pushed_over == 0.0
    one = choose_option(overloaded(md_running=1), PDD_RECOMPUTE)  # one short request would feel it
    assert one.option is Option.RELAY


def test_a_request_joining_during_a_recompute_counts_mds_queue_in_its_own_tpot() -> None:
    queued = MdPrefill(8000.0, queue_s=2.0)  # MD prefills other prompts for 2 s still
    d = choose_option(overloaded(queued, md_running=0, md_outputs=LONG), PDD_RECOMPUTE)
    assert d.option is not None and d.option is not Option.RECOMPUTE  # ready after the queue: relays
    relay = d.estimate(Option.RELAY)
    assert relay is not None and relay.md_pushed_over == 0.0
    ship_later = replace(
        overloaded(queued, md_running=0, md_outputs=LONG), routing=routing(link=LinkEstimate(LINE, 0.02))
    )
    ship = choose_option(ship_later, PDD_RECOMPUTE).estimate(Option.SHIP)
    assert ship is not None and ship.tpot_s > 0.02  # its own decode starts behind MD's queue


def test_relay_keeps_the_bound_when_rld_decodes_it_all_though_md_is_slow() -> None:
    d = choose_option(overloaded(md_tpot_s=0.05), PDD_RECOMPUTE)
    relay = d.estimate(Option.RELAY)
    assert d.option is Option.RELAY and relay is not None and relay.rld_tokens == 64


def test_every_option_breaking_the_bound_is_rejected_typed() -> None:
    # MD and RLD both decode slower than the bound already: nothing keeps it, whatever it ships
    slow_md = replace(overloaded(md_tpot_s=0.05), routing=routing(link=BUSY, rld_tpot_s=0.04))
    admitted = choose_option(replace(slow_md, tpot_bound_s=None), PDD_RECOMPUTE)
    assert admitted.admitted
    d = choose_option(slow_md, PDD_RECOMPUTE)
    assert d.option is None and d.reason is RejectReason.TPOT_UNREACHABLE
    assert d.retry_after_s >= 1.0 and all(e.tpot_s > BOUND for e in d.estimates)


def test_without_a_relay_recompute_may_push_over_up_to_the_one_request_it_serves() -> None:
    lengths = OutputLengths.of([10] * 30 + [700])  # 30% of the tokens in requests of 10 tokens
    three = overloaded(md_outputs=lengths, md_running=3, ttft_deadline_s=2.0)  # 0.9 expected
    assert choose_option(three, PDD_RECOMPUTE).option is Option.RELAY
    no_relay = replace(PDD_RECOMPUTE, relay_enabled=False)
    assert choose_option(three, no_relay).option is Option.RECOMPUTE  # 0.9 <= 1: worth it
    four = replace(three, md_running=4)  # 1.2 expected: costs more than it serves
    d = choose_option(four, no_relay)
    assert d.option is None and d.reason is RejectReason.TPOT_UNREACHABLE


def test_rlds_token_budget_closes_the_relay_options() -> None:
    budget = replace(PDD_RECOMPUTE, rld_token_budget=0.2)
    under = choose_option(overloaded(rld_token_share=0.19), budget)
    assert under.option is Option.RELAY
    over = choose_option(overloaded(rld_token_share=0.2, ttft_deadline_s=2.0), budget)
    assert {e.option for e in over.estimates} == {Option.SHIP, Option.RECOMPUTE}
    # the line is too slow for the first token and a blocking recompute breaks the bound
    assert over.option is None and over.reason is RejectReason.TPOT_UNREACHABLE
    fits = choose_option(overloaded(rld_token_share=0.2, md_outputs=LONG), budget)
    assert fits.option is Option.RECOMPUTE  # a stall MD's batch can carry still recomputes
    # no budget (1): RLD may take every token
    assert choose_option(overloaded(rld_token_share=1.0), PDD_RECOMPUTE).option is Option.RELAY


@settings(max_examples=300, deadline=None)
@given(option_inputs(), policies, st.floats(0.05, 0.95), st.floats(0, 1))
def test_no_relay_option_once_rld_has_had_its_share(
    inputs: OptionInputs, policy: RoutingPolicy, budget: float, share: float
) -> None:
    d = choose_option(replace(inputs, rld_token_share=share), replace(policy, rld_token_budget=budget))
    if share >= budget:
        assert d.option is None or not d.option.relays
        assert all(not e.option.relays for e in d.estimates)


def test_deadline_rejections_keep_their_reason_under_a_bound() -> None:
    jammed = LinkEstimate(LINE, 0.02, flows_in_flight=30, backlog_bytes=200_000_000)
    inputs = OptionInputs(routing(link=jammed), deadline_s=5.0, md_prefill=None, tpot_bound_s=BOUND)
    d = choose_option(inputs, RoutingPolicy(relay_enabled=False))
    assert d.option is None and d.reason is RejectReason.DEADLINE_UNREACHABLE


def test_bad_tpot_inputs_are_refused() -> None:
    with pytest.raises(ConfigError):
        overloaded(tpot_bound_s=0.0)
    with pytest.raises(ConfigError):
        MdPrefill(8000.0, chunk_tokens=0)
    with pytest.raises(ConfigError):
        overloaded(rld_token_share=1.5)
    with pytest.raises(ConfigError):
        RoutingPolicy(rld_token_budget=0.0)


@settings(max_examples=300, deadline=None)
@given(
    option_inputs(),
    policies,
    st.floats(0.001, 0.3),
    st.integers(0, 64),
    st.lists(st.integers(0, 2000), max_size=20),
    st.none() | st.integers(1, 4096),
)
def test_never_breaks_the_bound_when_an_option_keeps_it(
    inputs: OptionInputs,
    policy: RoutingPolicy,
    bound: float,
    running: int,
    outputs: list[int],
    chunk: int | None,
) -> None:
    md = inputs.md_prefill and replace(inputs.md_prefill, chunk_tokens=chunk)
    lengths = OutputLengths.of(outputs)
    bounded = replace(inputs, tpot_bound_s=bound, md_running=running, md_outputs=lengths, md_prefill=md)
    d = choose_option(bounded, policy)
    every = estimate_options(bounded, policy)
    deadlines = (bounded.deadline_s, bounded.ttft_deadline_s)
    chosen = d.estimate(d.option) if d.option is not None else None
    if any(e.option.relays and e.meets(*deadlines, bound) for e in every):  # recompute: nearly free
        assert chosen is not None and chosen.meets(*deadlines, bound)
    elif any(e.meets(*deadlines, bound, PUSHED_OVER_LIMIT_WITHOUT_RELAY) for e in every):
        assert chosen is not None and chosen.meets(*deadlines, bound, PUSHED_OVER_LIMIT_WITHOUT_RELAY)
    elif any(e.meets(bounded.deadline_s, bounded.ttft_deadline_s) for e in every):
        assert d.option is None and d.reason is RejectReason.TPOT_UNREACHABLE
    else:
        assert d.option is None and d.reason is not RejectReason.TPOT_UNREACHABLE


@settings(max_examples=300, deadline=None)
@given(option_inputs(), policies, st.integers(0, 64))
def test_a_bound_nothing_reaches_decides_as_no_bound(
    inputs: OptionInputs, policy: RoutingPolicy, running: int
) -> None:
    plain = replace(inputs, md_running=running)
    loose = replace(plain, tpot_bound_s=1e9)
    a, b = choose_option(plain, policy), choose_option(loose, policy)
    assert (a.option, a.reason) == (b.option, b.reason)


THIN = 3.3e6 / 8  # wan-overload's line: 3.3 Mbit/s
SHORT_AND_LONG = OutputLengths.of([8] * 20 + [128] * 5)  # a fifth of the tokens in 8-token requests


def thin_line(matched: int = 0, ttft_deadline_s: float | None = 2.0) -> OptionInputs:
    """wan-overload's first request: a low-hit prompt on a thin line, MD decoding one request, a
    blocking recompute expected to push 0.2 of a running request over the 10 ms bound."""
    return OptionInputs(
        routing(prompt=785, matched=matched, max_out=103, link=LinkEstimate(THIN, 0.02), rld_tpot_s=0.008),
        deadline_s=18.0, ttft_deadline_s=ttft_deadline_s, md_prefill=MdPrefill(3300.0),
        md_tpot_s=0.004, tpot_bound_s=0.010, md_running=1, md_outputs=SHORT_AND_LONG,
    )  # fmt: skip


def test_a_relay_whose_kv_holds_the_line_past_the_ttft_bound_is_not_taken() -> None:
    # without a TTFT bound RLD serves it (recompute would push 0.2 over the TPOT bound)
    assert choose_option(thin_line(ttft_deadline_s=None), PDD_RECOMPUTE).option is Option.RELAY
    d = choose_option(thin_line(), PDD_RECOMPUTE)
    relay, rec = d.estimate(Option.RELAY), d.estimate(Option.RECOMPUTE)
    assert relay is not None and relay.ttft_s < 0.2  # its own first token is early ...
    assert relay.line_s == pytest.approx(785 * 2048 / THIN)  # ... but its 1.6 MB hold the line 3.9 s
    assert not relay.meets(18.0, 2.0, 0.010)
    assert rec is not None and 0.1 < rec.md_pushed_over < PUSHED_OVER_LIMIT_WITHOUT_RELAY
    # no relay keeps every bound: MD prefills it while RLD streams (only token ids on the line)
    assert d.option is Option.RELAY_RECOMPUTE and d.wan_bytes == 0


def test_a_relay_of_a_small_suffix_still_fits_the_ttft_bound() -> None:
    d = choose_option(thin_line(matched=704), PDD_RECOMPUTE)  # 81 tokens: 0.4 s of line
    relay = d.estimate(Option.RELAY)
    assert relay is not None and relay.line_s == pytest.approx(81 * 2048 / THIN)
    assert relay.meets(18.0, 2.0, 0.010)
    assert d.option is Option.RECOMPUTE  # 25 ms of MD's prefill: sooner than anything else


def test_a_stall_pushes_over_exactly_the_requests_shorter_than_stall_over_headroom() -> None:
    """A request of n tokens at t per token, stalled S, ends at (n t + S) / n: over the bound B
    exactly when n < S / (B - t), however far it has got; the rule's headroom is never more than
    that (every request the stall pushes over is counted) and never nothing while t < B."""
    bound, tpot, stall = 0.010, 0.0092, 0.1
    for n in (124, 126):
        assert ((n * tpot + stall) / n > bound) is (n < stall / (bound - tpot))
    headroom = tpot_headroom_s(bound, tpot)
    assert headroom == pytest.approx(0.0004)  # half of what is left: 0.9 x 10 ms - 9.2 ms is < 0
    below = MdPrefill(tokens_per_s=1.0, queue_s=stall).pushed_over_below(0, headroom)
    assert below == pytest.approx(250.0) and below >= stall / (bound - tpot)
    assert tpot_headroom_s(0.030, 0.020) == pytest.approx(0.007)  # well below: 0.9 x 30 ms - 20 ms
    assert tpot_headroom_s(0.030, 0.031) < 0  # past the bound: none at all


@settings(max_examples=200, deadline=None)
@given(bound=st.floats(1e-3, 1.0), share=st.floats(0.0, 0.9999))
def test_the_headroom_is_within_what_the_bound_leaves_and_never_nothing_below_it(
    bound: float, share: float
) -> None:
    tpot = share * bound
    headroom = tpot_headroom_s(bound, tpot)
    assert 0.5 * (bound - tpot) * (1 - 1e-9) <= headroom <= (bound - tpot) * (1 + 1e-9)
    assert headroom > 0


def test_md_near_nine_tenths_of_the_bound_still_recomputes_for_long_running_requests() -> None:
    """wan-overload: MD at 9.2 ms per token against a 10 ms bound. The rule with a 0.9 margin saw no
    slack and counted every running request pushed over; 96 ms spread over requests of 300
    tokens adds 0.32 ms each, within the 0.4 ms of headroom the rule gives them."""
    long_outputs = OutputLengths.of([300] * 50)
    near = overloaded(md_outputs=long_outputs, md_running=6, md_tpot_s=0.0092, tpot_bound_s=0.010)
    rec = choose_option(near, PDD_RECOMPUTE).estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_pushed_over == 0.0  # the 0.9 margin: 6.0
    assert rec.meets_tpot(0.010)
    short_outputs = OutputLengths.of([200] * 50)  # 0.48 ms each: every one of the 6 over
    short = replace(near, md_outputs=short_outputs)
    rec = choose_option(short, PDD_RECOMPUTE).estimate(Option.RECOMPUTE)
    assert rec is not None and rec.md_pushed_over == pytest.approx(6.0)


def test_a_fixed_prefill_cost_counts_in_mds_ready_time_and_stall() -> None:
    md = MdPrefill(tokens_per_s=4000.0, queue_s=0.05, fixed_s=0.012)
    assert md.work_s(400) == pytest.approx(0.05 + 0.012 + 0.1)
    assert md.work_s(0) == pytest.approx(0.05)  # nothing to prefill: no fixed cost
    assert md.ready_s(400) == pytest.approx(0.162)
    assert md.tpot_cost_s(400, 100) == pytest.approx(0.162 / 100)
    with pytest.raises(ConfigError):
        MdPrefill(tokens_per_s=4000.0, fixed_s=-0.001)


def test_a_relay_whose_md_is_ready_before_rld_first_token_hands_over_after_it() -> None:
    # MD recomputes 64 tokens in 8 ms, long before RLD's first token (P's prefill 0.5 s): MD starts
    # from that token, so the request ends after it (an estimate from MD's readiness alone put the
    # end before the first token: a negative TPOT that made the relay look fastest)
    inputs = overloaded(md_running=0, p_prefill_s=0.5)
    inputs = replace(inputs, routing=routing(prompt=64, link=BUSY))
    relay = next(e for e in estimate_options(inputs, PDD_RECOMPUTE) if e.option is Option.RELAY_RECOMPUTE)
    assert relay.md_ready_s < relay.ttft_s
    assert relay.finish_s == pytest.approx(relay.ttft_s + relay.tpot_s * 63)
    assert relay.tpot_s == pytest.approx(0.02, rel=0.05)  # MD's own pace after RLD's one token


@settings(max_examples=400, deadline=None)
@given(option_inputs(), policies)
def test_no_option_ends_before_its_first_token(inputs: OptionInputs, policy: RoutingPolicy) -> None:
    for e in estimate_options(replace(inputs, tpot_bound_s=BOUND), policy):
        assert e.finish_s >= e.ttft_s - 1e-9 and e.tpot_s >= 0.0, e


def test_a_finished_requests_tpot_is_judged_against_the_bound_after_its_first_token() -> None:
    assert missed_tpot(1.0, 1.8, 9, 0.09)  # 0.8 s over 8 tokens: 100 ms each
    assert not missed_tpot(1.0, 1.8, 9, 0.1) and not missed_tpot(1.0, 1.8, 9, None)
    assert not missed_tpot(1.0, 5.0, 1, 0.001)  # one token: no time per further token
