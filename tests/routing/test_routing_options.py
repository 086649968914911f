"""Ship or recompute, relay or not, admit or reject: ``choose_option`` on concrete and generated
inputs, and its agreement with ``choose_pipeline`` where recompute and deadlines are off."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.routing import (
    DecisionReason,
    LinkEstimate,
    MdPrefill,
    Option,
    OptionInputs,
    RejectReason,
    RoutingInputs,
    RoutingPolicy,
    choose_option,
    choose_pipeline,
    estimate_options,
)

LINE = 2e6  # 16 Mbit/s
KV = 2048


def routing(prompt: int = 768, matched: int = 0, max_out: int = 64, **kw: object) -> RoutingInputs:
    base: dict[str, object] = dict(
        prompt_tokens=prompt,
        matched_tokens=matched,
        kv_bytes_per_token=KV,
        max_output_tokens=max_out,
        link=LinkEstimate(LINE, 0.02),
        rld_capacity=6,
        rld_tpot_s=0.02,
    )
    base.update(kw)
    return RoutingInputs(**base)  # type: ignore[arg-type]


PDD_RECOMPUTE = RoutingPolicy(relay_min_wan_s=0.15, recompute_enabled=True, singular_max_output_tokens=4)
MD = MdPrefill(tokens_per_s=8000.0)


def test_overloaded_line_recomputes_instead_of_shipping() -> None:
    busy = LinkEstimate(LINE, 0.02, flows_in_flight=10, backlog_bytes=40_000_000)
    d = choose_option(OptionInputs(routing(link=busy), deadline_s=30, md_prefill=MD), PDD_RECOMPUTE)
    assert d.option is Option.RECOMPUTE and d.reason is DecisionReason.RECOMPUTE
    assert d.wan_bytes == 0 and d.wan_estimate_s > 1.0


def test_slow_md_prefill_relays_and_recomputes_behind_rld() -> None:
    busy = LinkEstimate(LINE, 0.02, flows_in_flight=10, backlog_bytes=40_000_000)
    slow = MdPrefill(tokens_per_s=1000.0)  # 0.77 s of recompute, but far sooner than the WAN
    d = choose_option(OptionInputs(routing(link=busy), deadline_s=30, md_prefill=slow), PDD_RECOMPUTE)
    assert d.option is Option.RELAY_RECOMPUTE and d.reason is DecisionReason.LARGE_DELTA
    est = d.estimate(Option.RELAY_RECOMPUTE)
    assert est is not None and est.ttft_s < 0.1 and est.rld_tokens < 64


def test_small_delta_still_ships() -> None:
    d = choose_option(OptionInputs(routing(matched=752), deadline_s=30, md_prefill=MD), PDD_RECOMPUTE)
    assert d.option is Option.SHIP and d.wan_bytes == 16 * KV


def test_nothing_meets_the_deadline_rejects_with_a_retry_hint() -> None:
    busy = LinkEstimate(LINE, 0.02, flows_in_flight=30, backlog_bytes=200_000_000)
    baseline = RoutingPolicy(relay_enabled=False)
    d = choose_option(OptionInputs(routing(link=busy), deadline_s=5.0, md_prefill=MD), baseline)
    assert d.option is None and not d.admitted and d.reason is RejectReason.DEADLINE_UNREACHABLE
    assert d.retry_after_s >= 1.0


def test_rld_at_its_ceiling_takes_no_relay() -> None:
    busy = LinkEstimate(LINE, 0.02, flows_in_flight=10, backlog_bytes=40_000_000)
    slow = MdPrefill(tokens_per_s=1000.0)
    full = routing(link=busy, rld_active=6)
    d = choose_option(OptionInputs(full, deadline_s=30, md_prefill=slow), PDD_RECOMPUTE)
    assert d.option is Option.RECOMPUTE and d.reason is DecisionReason.RLD_BUSY


links = st.builds(
    LinkEstimate,
    line_bytes_per_s=st.floats(1e5, 1e10),
    rtt_s=st.floats(0, 0.2),
    flows_in_flight=st.integers(0, 100),
    backlog_bytes=st.integers(0, 10**10),
    pool_size=st.integers(1, 128),
)


@st.composite
def option_inputs(draw: st.DrawFn) -> OptionInputs:
    prompt = draw(st.integers(1, 100_000))
    r = RoutingInputs(
        prompt_tokens=prompt,
        matched_tokens=draw(st.integers(0, prompt)),
        kv_bytes_per_token=draw(st.integers(1, 10_000)),
        max_output_tokens=draw(st.integers(1, 4096)),
        link=draw(links),
        rld_available=draw(st.booleans()),
        rld_active=draw(st.integers(0, 12)),
        rld_capacity=draw(st.integers(1, 10)),
        rld_tpot_s=draw(st.floats(0.001, 0.2)),
        ttft_target_s=draw(st.none() | st.floats(0.01, 10)),
    )
    md = draw(st.none() | st.builds(MdPrefill, st.floats(10, 1e6), st.floats(0, 20)))
    return OptionInputs(
        r,
        deadline_s=draw(st.none() | st.floats(0.01, 120)),
        ttft_deadline_s=draw(st.none() | st.floats(0.01, 30)),
        p_prefill_s=draw(st.floats(0, 10)),
        fast_s=draw(st.floats(0, 1)),
        md_prefill=md,
        md_tpot_s=draw(st.floats(0.001, 0.2)),
        extend_s=draw(st.floats(0, 1)),
    )


policies = st.builds(
    RoutingPolicy,
    relay_enabled=st.booleans(),
    relay_min_wan_s=st.floats(0, 5),
    rld_max_load=st.floats(0, 1),
    singular_max_output_tokens=st.none() | st.integers(1, 64),
    recompute_enabled=st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(option_inputs(), policies)
def test_never_misses_the_deadline_when_an_option_meets_it(
    inputs: OptionInputs, policy: RoutingPolicy
) -> None:
    d = choose_option(inputs, policy)
    meets = [
        e for e in estimate_options(inputs, policy) if e.meets(inputs.deadline_s, inputs.ttft_deadline_s)
    ]
    if meets:
        chosen = d.estimate(d.option) if d.option is not None else None
        assert chosen is not None and chosen.meets(inputs.deadline_s, inputs.ttft_deadline_s)
    else:
        assert d.option is None and d.retry_after_s > 0


@settings(max_examples=400, deadline=None)
@given(option_inputs(), policies)
def test_never_exceeds_rld_ceiling_nor_uses_what_is_off(inputs: OptionInputs, policy: RoutingPolicy) -> None:
    d = choose_option(inputs, policy)
    r = inputs.routing
    if d.option is None:
        return
    if d.option in (Option.RELAY, Option.RELAY_RECOMPUTE):
        assert r.rld_available and r.rld_load < policy.rld_max_load
    if d.option.relays:
        assert policy.relay_enabled and r.rld_load < 1.0
    if d.option is Option.SINGULAR:
        assert policy.allows_singular(r.max_output_tokens)
    if d.option.recomputes:
        assert policy.recompute_enabled and inputs.md_prefill is not None
    assert d.wan_bytes == (r.wan_bytes if d.option.ships_kv else 0)


@settings(max_examples=400, deadline=None)
@given(option_inputs(), policies)
def test_without_recompute_or_deadline_it_is_choose_pipeline(
    inputs: OptionInputs, policy: RoutingPolicy
) -> None:
    from dataclasses import replace

    plain = replace(inputs, deadline_s=None, ttft_deadline_s=None, md_prefill=None)
    d = choose_option(plain, policy)
    old = choose_pipeline(inputs.routing, policy)
    assert d.option is not None and d.option.pipeline is old.pipeline and d.reason is old.reason
