"""Placement over a fleet: the MD holding the prefix wins, a backlogged link loses, unhealthy and
draining instances are never chosen, baselines behave as named, refusals are typed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import ConfigError, InvalidInput
from pddlink.routing import (
    FleetView,
    LinkEstimate,
    LinkView,
    MdSnapshot,
    Placement,
    PlacementConfig,
    PlacementMemory,
    PlacementPolicy,
    PlacementReason,
    PlacementRefusal,
    PlacementRequest,
    PSnapshot,
    RefusalReason,
    RldSnapshot,
    choose_rld,
    place,
)

MB = 10**6
REQ = PlacementRequest(
    prompt_tokens=1024, block_tokens=16, kv_bytes_per_token=2048, block_hashes=tuple(range(64))
)
IDLE_B = LinkEstimate(line_bytes_per_s=2 * MB, rtt_s=0.02)
IDLE_C = LinkEstimate(line_bytes_per_s=2 * MB, rtt_s=0.02)


def fleet(
    *md: MdSnapshot, link_c: LinkEstimate = IDLE_C, p: tuple[PSnapshot, ...] | None = None
) -> FleetView:
    ps = p if p is not None else (PSnapshot("p0", "a", 0.5), PSnapshot("p1", "a", 0.1))
    rlds = (RldSnapshot("r0", "a", 3), RldSnapshot("r1", "a", 1))
    return FleetView(ps, md, rlds, (LinkView("a", "b", IDLE_B), LinkView("c", "a", link_c)))


def mds(*blocks: int) -> tuple[MdSnapshot, ...]:
    """MDs b0, b1 in datacenter b and c0, c1 in c, holding ``blocks`` of the prompt."""
    names = [("b0", "b"), ("b1", "b"), ("c0", "c"), ("c1", "c")]
    return tuple(MdSnapshot(n, dc, k) for (n, dc), k in zip(names, blocks, strict=False))


def placed(result: Placement | PlacementRefusal) -> Placement:
    assert isinstance(result, Placement), result
    return result


def test_prefix_aware_picks_the_md_holding_the_prefix() -> None:
    got = placed(place(REQ, fleet(*mds(0, 10, 60, 3))))
    assert (got.md, got.p, got.rld, got.reason) == ("c0", "p1", "r1", PlacementReason.BEST_TTFT)
    assert got.matched_tokens == 960  # 60 blocks of 16
    # 0.1 s P queue + the WAN time of 64 missing tokens over an idle line
    assert got.estimated_ttft_s == pytest.approx(0.1 + IDLE_C.transfer_s(64 * 2048))


def test_matched_tokens_never_reach_the_whole_prompt() -> None:
    got = placed(place(replace(REQ, prompt_tokens=64 * 16), fleet(*mds(64))))
    assert got.matched_tokens == 64 * 16 - 1


def test_prefix_aware_avoids_a_backlogged_link() -> None:
    # c0 holds more of the prompt, but c's line shares its rate with 100 transfers (200 MB queued):
    # its 128 KB would take ~6.6 s there; b0's 768 KB over b's idle line take ~0.4 s.
    busy = LinkEstimate(line_bytes_per_s=2 * MB, rtt_s=0.02, flows_in_flight=100, backlog_bytes=200 * MB)
    got = placed(place(REQ, fleet(*mds(40, 0, 60, 0), link_c=busy)))
    assert got.md == "b0"
    assert placed(place(REQ, fleet(*mds(40, 0, 60, 0)))).md == "c0"  # the same fleet, c's line idle


def test_a_slower_line_needs_a_bigger_hit_to_win() -> None:
    slow = LinkEstimate(line_bytes_per_s=MB / 2, rtt_s=0.04)
    assert placed(place(REQ, fleet(*mds(30, 0, 31, 0), link_c=slow))).md == "b0"
    assert placed(place(REQ, fleet(*mds(30, 0, 60, 0), link_c=slow))).md == "c0"


def test_ties_go_to_the_least_loaded() -> None:
    a, b = mds(20, 20)
    got = placed(place(REQ, fleet(replace(a, running_requests=5), replace(b, running_requests=2))))
    assert got.md == "b1"


def test_prefix_aware_ties_in_time_and_load_rotate_with_memory_and_go_first_without() -> None:
    b0, b1, c0, c1 = mds(20, 20, 0, 0)  # b0 and b1 tie on time; c's MDs need the whole prompt
    view = fleet(b0, b1, c0, replace(c1, running_requests=1))
    memory = PlacementMemory()
    assert [placed(place(REQ, view, memory=memory)).md for _ in range(3)] == ["b0", "b1", "b0"]
    assert placed(place(REQ, view)).md == "b0"
    loaded = fleet(replace(b0, running_requests=1), b1, c0, c1)
    assert [placed(place(REQ, loaded, memory=memory)).md for _ in range(2)] == ["b1", "b1"]


def test_balance_limits_pass_over_an_overloaded_md_unless_all_are() -> None:
    full, other = mds(60, 0)
    queued = replace(full, waiting_requests=17)
    assert placed(place(REQ, fleet(queued, other))).md == "b1"
    assert placed(place(REQ, fleet(replace(full, waiting_requests=16), other))).md == "b0"
    hot = PlacementConfig(balance_tpot_s=0.03)
    assert placed(place(REQ, fleet(replace(full, step_s=0.03), other), hot)).md == "b1"
    both_hot = fleet(replace(full, step_s=0.04), replace(other, step_s=0.05))
    assert placed(place(REQ, both_hot, hot)).md == "b0"  # every one over the bound: the limit is off
    assert placed(place(REQ, fleet(replace(full, kv_use_fraction=1.0), other))).md == "b1"


@pytest.mark.parametrize("policy", list(PlacementPolicy))
def test_unhealthy_or_draining_instances_are_never_chosen(policy: PlacementPolicy) -> None:
    b0, b1, c0, c1 = mds(60, 50, 40, 30)
    sick = (replace(b0, healthy=False), replace(b1, draining=True), c0, c1)
    ps = (
        PSnapshot("p0", "a", 0.0, healthy=False),
        PSnapshot("p1", "a", 9.0),
        PSnapshot("p2", "a", 0.0, draining=True),
    )
    memory = PlacementMemory()
    memory.remember(REQ.block_hashes, "b0")  # prefix_hash remembers the sick one
    for _ in range(6):
        got = placed(place(REQ, fleet(*sick, p=ps), PlacementConfig(policy=policy), memory))
        assert got.md in {"c0", "c1"} and got.p == "p1"


def test_no_healthy_instance_of_a_role_is_a_typed_refusal() -> None:
    down = tuple(replace(m, healthy=False) for m in mds(1, 2))
    assert place(REQ, fleet(*down)) == PlacementRefusal(
        RefusalReason.NO_MD, "no healthy, undrained MD instance"
    )
    no_p = fleet(*mds(1), p=(PSnapshot("p0", "a", draining=True),))
    refusal = place(REQ, no_p)
    assert isinstance(refusal, PlacementRefusal) and refusal.reason is RefusalReason.NO_P
    unlinked = FleetView((PSnapshot("p0", "a"),), (MdSnapshot("x0", "x", 5),))
    refusal = place(REQ, unlinked)
    assert isinstance(refusal, PlacementRefusal) and refusal.reason is RefusalReason.NO_ROUTE


def test_no_rld_is_no_relay_not_a_refusal() -> None:
    view = replace(fleet(*mds(1)), rld=(RldSnapshot("r0", "a", healthy=False),))
    assert placed(place(REQ, view)).rld is None
    assert (
        choose_rld((RldSnapshot("r0", "a", 2), RldSnapshot("r1", "z", 0), RldSnapshot("r2", "a", 2)), "a")
        == "r0"
    )


def test_round_robin_cycles_over_the_live_mds() -> None:
    memory, config = PlacementMemory(), PlacementConfig(policy=PlacementPolicy.ROUND_ROBIN)
    view = fleet(*mds(60, 0, 0, 0))
    picks = [placed(place(REQ, view, config, memory)).md for _ in range(8)]
    assert picks == ["b0", "b1", "c0", "c1"] * 2
    got = placed(place(REQ, view, config, memory))
    assert got.reason is PlacementReason.ROUND_ROBIN and got.matched_tokens == 960  # b0's own mirror


def test_round_robin_and_prefix_hash_need_memory() -> None:
    with pytest.raises(InvalidInput):
        place(REQ, fleet(*mds(1)), PlacementConfig(policy=PlacementPolicy.ROUND_ROBIN))


def test_least_loaded_ignores_the_cache() -> None:
    b0, b1 = mds(60, 0)
    got = placed(
        place(
            REQ,
            fleet(replace(b0, running_requests=3), b1),
            PlacementConfig(policy=PlacementPolicy.LEAST_LOADED),
        )
    )
    assert (got.md, got.matched_tokens, got.reason) == ("b1", 0, PlacementReason.LEAST_LOADED)


def test_least_loaded_ties_rotate_with_memory_and_go_first_without() -> None:
    b0, b1, c0, c1 = mds(0, 0, 0, 0)
    view, config = (
        fleet(b0, replace(b1, waiting_requests=1), c0, c1),
        PlacementConfig(policy=PlacementPolicy.LEAST_LOADED),
    )
    memory = PlacementMemory()
    assert [placed(place(REQ, view, config, memory)).md for _ in range(4)] == ["b0", "c0", "c1", "b0"]
    assert placed(place(REQ, view, config)).md == "b0"


def test_prefix_hash_sticks_to_where_it_sent_the_prefix() -> None:
    memory, config = PlacementMemory(), PlacementConfig(policy=PlacementPolicy.PREFIX_HASH)
    b0, b1, c0, c1 = mds(0, 0, 0, 0)
    view = fleet(replace(b0, running_requests=2), b1, c0, c1)
    first = placed(place(REQ, view, config, memory))
    assert (first.md, first.reason) == ("b1", PlacementReason.NEW_PREFIX)  # least loaded
    # Now b1 is the busiest and its mirror says nothing (no events): the memory still sends it there.
    busy = fleet(b0, replace(b1, running_requests=9), c0, c1)
    longer = replace(REQ, block_hashes=(*REQ.block_hashes[:40], 1000, 1001))
    again = placed(place(longer, busy, config, memory))
    assert (again.md, again.reason) == ("b1", PlacementReason.REMEMBERED_PREFIX)
    other = replace(REQ, block_hashes=(7000, 7001))
    fresh = placed(place(other, busy, config, memory))
    assert (fresh.md, fresh.reason) == ("c0", PlacementReason.NEW_PREFIX)  # idle b0, c0, c1: 2nd turn
    memory.forget("b1")
    assert memory.remembered(longer.block_hashes) is None


def test_prefix_hash_memory_is_bounded_lru() -> None:
    memory = PlacementMemory(capacity_blocks=3)
    memory.remember((1, 2), "x")
    memory.remember((3, 4), "y")
    assert len(memory) == 3 and memory.remembered((1,)) is None
    assert memory.remembered((2, 99)) == ("x", 1) and memory.remembered((3, 4)) == ("y", 2)


def test_oracle_knows_the_true_caches() -> None:
    b0, b1 = mds(60, 10)
    stale = (replace(b0, exact_matched_blocks=0), replace(b1, exact_matched_blocks=50, waiting_requests=99))
    got = placed(place(REQ, fleet(*stale), PlacementConfig(policy=PlacementPolicy.ORACLE)))
    assert (got.md, got.matched_tokens, got.reason) == ("b1", 800, PlacementReason.EXACT_CACHE)
    assert placed(place(REQ, fleet(*stale))).md == "b0"  # the mirrors' view; b1 is past the balance limit


def test_md_beside_p_pays_no_wan_and_p_prefill_counts() -> None:
    ps = (PSnapshot("p0", "a", 0.0, prefill_tokens_per_s=1000.0),)
    view = FleetView(
        ps, (MdSnapshot("near", "a", 10), MdSnapshot("far", "b", 10)), (), (LinkView("a", "b", IDLE_B),)
    )
    got = placed(place(REQ, view))
    assert got.md == "near" and got.estimated_ttft_s == pytest.approx((1024 - 160) / 1000.0)


def test_p_goes_to_the_datacenter_that_reaches_the_md_first() -> None:
    ps = (PSnapshot("pa", "a", 0.2), PSnapshot("pb", "b", 0.3))
    view = FleetView(
        ps,
        (MdSnapshot("m", "b", 0),),
        (RldSnapshot("ra", "a"), RldSnapshot("rb", "b")),
        (LinkView("a", "b", IDLE_B),),
    )
    got = placed(place(REQ, view))
    assert (got.p, got.rld) == ("pb", "rb")  # 0.3 s beats 0.2 s + 1024 tokens of KV at 2 MB/s


def test_config_and_request_are_validated() -> None:
    with pytest.raises(ConfigError):
        PlacementConfig(md_kv_use_max=0.0)
    with pytest.raises(InvalidInput):
        PlacementRequest(prompt_tokens=0, block_tokens=16, kv_bytes_per_token=1)


@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 20), st.booleans()), min_size=1, max_size=6))
def test_prefix_aware_never_picks_a_worse_hit_on_one_shared_idle_line(
    cells: list[tuple[int, int, bool]],
) -> None:
    md = tuple(
        MdSnapshot(f"m{i}", "b", k, running_requests=n, healthy=h) for i, (k, n, h) in enumerate(cells)
    )
    got = place(REQ, FleetView((PSnapshot("p", "a"),), md, (), (LinkView("a", "b", IDLE_B),)))
    live = [m for m in md if m.healthy]
    if not live:
        assert isinstance(got, PlacementRefusal)
        return
    got = placed(got)
    best = max(m.matched_blocks for m in live)
    chosen = next(m for m in live if m.name == got.md)
    assert chosen.matched_blocks == best
    assert chosen.load == min(m.load for m in live if m.matched_blocks == best)


def _old_sim_pick(md: tuple[MdSnapshot, ...], cap: float | None) -> int:
    """The simulator's decode pick before placement existed (``sim.engine._pick_decode``)."""
    limit = min(m.waiting_requests for m in md) + 16
    hot = [cap is not None and m.step_s >= cap for m in md]
    if all(hot):
        hot = [False] * len(md)
    best, best_match = -1, -1
    for i, m in enumerate(md):
        if m.waiting_requests > limit or hot[i]:
            continue
        if m.matched_blocks > best_match or (m.matched_blocks == best_match and m.load < md[best].load):
            best, best_match = i, m.matched_blocks
    return best


@given(
    st.lists(
        st.tuples(st.integers(0, 64), st.integers(0, 40), st.integers(0, 40), st.floats(0.005, 0.05)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([None, 0.03]),
    st.integers(0, 300),
    st.integers(0, 10**9),
)
def test_prefix_aware_on_one_line_is_the_simulators_old_pick(
    cells: list[tuple[int, int, int, float]], cap: float | None, flows: int, backlog: int
) -> None:
    md = tuple(
        MdSnapshot(f"d{i}", "b", k, run, wait, 0.0, step) for i, (k, run, wait, step) in enumerate(cells)
    )
    old = _old_sim_pick(md, cap)
    if old < 0:
        return  # every instance over a limit: the old pick had no answer (placement takes them all)
    line = LinkEstimate(2 * MB, 0.02, flows_in_flight=flows, backlog_bytes=backlog, flow_cap_bytes_per_s=MB)
    ps = (PSnapshot("p0", "a", 1.5, 3300.0), PSnapshot("p1", "a", 0.5, 3300.0))
    got = placed(
        place(REQ, FleetView(ps, md, (), (LinkView("a", "b", line),)), PlacementConfig(balance_tpot_s=cap))
    )
    assert (got.md, got.p) == (md[old].name, "p1")


def test_prefix_aware_prefers_the_p_that_holds_the_prompt_unless_its_queue_costs_more() -> None:
    """Each P's own prefix cache counts in the estimate (``PSnapshot.matched_blocks``): P prefills
    what it lacks. 1024 tokens at 3300 tokens/s: 0.31 s from nothing, 0.005 s from 63 blocks."""
    md = mds(60, 60, 0, 0)
    cold, warm = (
        PSnapshot("p0", "a", 0.0, 3300.0, matched_blocks=0),
        PSnapshot("p1", "a", 0.1, 3300.0, matched_blocks=63),
    )
    got = placed(place(REQ, fleet(*md, p=(cold, warm))))
    assert (got.p, got.md) == ("p1", "b0")
    busy = replace(warm, queue_s=0.5)  # its queue now costs more than the prefill it saves
    assert placed(place(REQ, fleet(*md, p=(cold, busy)))).p == "p0"
    # unknown caches (no mirror of P): P is taken to prefill what MD lacks; the least queued wins
    unknown = (replace(cold, matched_blocks=None, queue_s=0.2), replace(warm, matched_blocks=None))
    assert placed(place(REQ, fleet(*md, p=unknown))).p == "p1"
    assert placed(place(REQ, fleet(*md, p=(unknown[0], replace(unknown[1], queue_s=0.3))))).p == "p0"


def test_the_baselines_take_the_least_queued_p_whatever_its_cache() -> None:
    """Round robin, least loaded and prefix_hash choose the MD by their own rule and P as before:
    the least-queued P of a datacenter reaching it (what they measure against is placement)."""
    cold, warm = (
        PSnapshot("p0", "a", 0.0, 3300.0, matched_blocks=0),
        PSnapshot("p1", "a", 0.1, 3300.0, matched_blocks=63),
    )
    for policy in (PlacementPolicy.ROUND_ROBIN, PlacementPolicy.LEAST_LOADED, PlacementPolicy.PREFIX_HASH):
        got = placed(
            place(REQ, fleet(*mds(60, 60, 0, 0), p=(cold, warm)), PlacementConfig(policy), PlacementMemory())
        )
        assert got.p == "p0", policy
