"""The pipeline policy: the rules the design states, checked on concrete and generated inputs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import ConfigError
from pddlink.routing import (
    DecisionReason,
    HandoffMode,
    LinkEstimate,
    Pipeline,
    RoutingInputs,
    RoutingPolicy,
    choose_handoff_mode,
    choose_pipeline,
)

GBPS_20 = 20e9 / 8
LINK = LinkEstimate(line_bytes_per_s=GBPS_20, rtt_s=0.02)
KV = 4400


def inputs(prompt: int = 65536, matched: int = 65000, max_out: int = 4096, **kw: object) -> RoutingInputs:
    base: dict[str, object] = dict(
        prompt_tokens=prompt,
        matched_tokens=matched,
        kv_bytes_per_token=KV,
        max_output_tokens=max_out,
        link=LINK,
        rld_available=True,
        rld_active=0,
        rld_capacity=8,
        rld_tpot_s=0.02,
    )
    base.update(kw)
    return RoutingInputs(**base)  # type: ignore[arg-type]


BUSY_LINK = LinkEstimate(line_bytes_per_s=GBPS_20, rtt_s=0.02, flows_in_flight=60, backlog_bytes=20 * 10**9)


def test_small_delta_goes_straight_to_md() -> None:
    d = choose_pipeline(inputs(matched=65000), RoutingPolicy())
    assert d.pipeline is Pipeline.P_MD and d.reason is DecisionReason.SMALL_DELTA
    assert d.wan_bytes == 536 * KV


def test_large_delta_on_a_busy_line_relays() -> None:
    d = choose_pipeline(inputs(matched=0, link=BUSY_LINK), RoutingPolicy())
    assert d.pipeline is Pipeline.P_RLD_MD and d.reason is DecisionReason.LARGE_DELTA
    assert d.wan_estimate_s >= 1.0 and d.wan_bytes == 65536 * KV


def test_short_output_bound_is_singular_only_when_rld_finishes_first() -> None:
    short = choose_pipeline(inputs(matched=0, link=BUSY_LINK, max_out=8), RoutingPolicy())
    assert short.pipeline is Pipeline.SINGULAR and short.wan_bytes == 0
    too_long = inputs(matched=0, link=BUSY_LINK, max_out=10**6)
    assert choose_pipeline(too_long, RoutingPolicy()).pipeline is Pipeline.P_RLD_MD
    no_filter = RoutingPolicy(singular_enabled=False)
    assert (
        choose_pipeline(inputs(matched=0, link=BUSY_LINK, max_out=8), no_filter).pipeline is Pipeline.P_RLD_MD
    )


def test_relay_disabled_unavailable_and_busy_fall_back_to_p_md() -> None:
    big = {"matched": 0, "link": BUSY_LINK}
    assert (
        choose_pipeline(inputs(**big), RoutingPolicy(relay_enabled=False)).reason
        is DecisionReason.RELAY_DISABLED
    )  # type: ignore[arg-type]
    assert (
        choose_pipeline(inputs(**big, rld_available=False), RoutingPolicy()).reason
        is DecisionReason.RLD_UNAVAILABLE
    )  # type: ignore[arg-type]
    assert choose_pipeline(inputs(**big, rld_active=8), RoutingPolicy()).reason is DecisionReason.RLD_BUSY  # type: ignore[arg-type]


def test_ttft_target_lowers_the_relay_threshold() -> None:
    mid = inputs(matched=60000)  # ~24 MB: ~10 ms on an idle 20 Gbps line
    assert choose_pipeline(mid, RoutingPolicy()).pipeline is Pipeline.P_MD
    tight = inputs(matched=60000, ttft_target_s=0.01)
    assert choose_pipeline(tight, RoutingPolicy()).pipeline is Pipeline.P_RLD_MD


@given(
    prompt=st.integers(1, 200_000),
    frac=st.floats(0, 1),
    max_out=st.integers(1, 10_000),
    active=st.integers(0, 16),
    flows=st.integers(0, 200),
    backlog=st.integers(0, 10**11),
)
def test_policy_invariants(
    prompt: int, frac: float, max_out: int, active: int, flows: int, backlog: int
) -> None:
    link = LinkEstimate(GBPS_20, 0.02, flows_in_flight=flows, backlog_bytes=backlog if flows else 0)
    inp = inputs(prompt=prompt, matched=int(prompt * frac), max_out=max_out, rld_active=active, link=link)
    policy = RoutingPolicy()
    d = choose_pipeline(inp, policy)
    # A request ends on RLD only when RLD finishes before the WAN transfer would.
    if d.pipeline is Pipeline.SINGULAR:
        assert max_out * inp.rld_tpot_s <= d.wan_estimate_s and inp.rld_load < 1
    else:
        assert d.wan_bytes == inp.wan_bytes
    if d.pipeline is Pipeline.P_RLD_MD:
        assert inp.rld_load < policy.rld_max_load and d.wan_estimate_s >= policy.relay_min_wan_s
    # More cached prefix never turns a P->MD request into a relayed one.
    if d.pipeline is Pipeline.P_MD and d.reason is DecisionReason.SMALL_DELTA:
        more = inputs(prompt=prompt, matched=prompt, max_out=max_out, rld_active=active, link=link)
        assert choose_pipeline(more, policy).pipeline is Pipeline.P_MD


def test_handoff_mode_follows_rld_load() -> None:
    policy = RoutingPolicy(catch_up_below_load=0.5, catch_up_slice_tokens=64)
    low = choose_handoff_mode(0.2, policy)
    assert low.mode is HandoffMode.CATCH_UP and low.slice_tokens == 64
    high = choose_handoff_mode(0.7, policy)
    assert high.mode is HandoffMode.ONE_SHOT and high.slice_tokens == 0
    assert choose_handoff_mode(0.0, RoutingPolicy(catch_up_below_load=0)).mode is HandoffMode.ONE_SHOT


@pytest.mark.parametrize(
    "kwargs",
    [dict(prompt=0), dict(matched=70000), dict(max_out=0), dict(rld_capacity=0), dict(rld_tpot_s=0.0)],
)
def test_bad_inputs_are_refused_with_the_field_named(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        inputs(**kwargs)  # type: ignore[arg-type]


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="rld_max_load"):
        RoutingPolicy(rld_max_load=1.5)


def test_singular_output_bound_is_part_of_the_policy() -> None:
    """Only outputs at most ``singular_max_output_tokens`` long may end on RLD; longer ones that RLD
    would still finish first relay (and end on MD) instead, the same as with the filter off."""
    capped = RoutingPolicy(singular_max_output_tokens=4)
    at_cap = choose_pipeline(inputs(matched=0, link=BUSY_LINK, max_out=4), capped)
    assert at_cap.pipeline is Pipeline.SINGULAR and at_cap.reason is DecisionReason.SHORT_OUTPUT
    over = inputs(matched=0, link=BUSY_LINK, max_out=5)
    assert choose_pipeline(over, RoutingPolicy()).pipeline is Pipeline.SINGULAR  # uncapped: timing alone
    assert choose_pipeline(over, capped) == choose_pipeline(over, RoutingPolicy(singular_enabled=False))
    assert capped.allows_singular(4) and not capped.allows_singular(5)
    assert not RoutingPolicy(singular_enabled=False, singular_max_output_tokens=4).allows_singular(1)
    with pytest.raises(ConfigError, match="singular_max_output_tokens"):
        RoutingPolicy(singular_max_output_tokens=0)
