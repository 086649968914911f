"""The handoff's start and the catch-up race, in memory: one decision for both engines (RLD's
reference sidecar, ``sidecar.relay_handoff``, and the router's vLLM legs, ``router.vllm_legs``,
both call ``open_handoff``; the vLLM legs run ``CatchUpRace``; the reference engine's slices are
``pddlink.handoff.HandoffPlan``, tested in tests/handoff)."""

from __future__ import annotations

import pytest

from pddlink.handoff import HandoffMode
from pddlink.lifecycle.handoff_choice import CatchUpRace, HandoffAsk, RaceVerdict, open_handoff
from pddlink.lifecycle.outcomes import HandoffOutcome, HandoffResult
from pddlink.routing import HandoffDecision, RoutingPolicy

POLICY = RoutingPolicy(catch_up_below_load=0.5, catch_up_slice_tokens=16)


def ask(**kw: object) -> HandoffAsk:
    base: dict[str, object] = {"generated": 5, "max_tokens": 64, "rld_load": 0.2}
    return HandoffAsk(**{**base, **kw})  # type: ignore[arg-type]


def test_rld_load_picks_the_mode() -> None:
    light = open_handoff(ask(rld_load=0.2), POLICY)
    busy = open_handoff(ask(rld_load=0.9), POLICY)
    assert light == HandoffDecision(HandoffMode.CATCH_UP, 16)
    assert isinstance(busy, HandoffDecision) and busy.mode is HandoffMode.ONE_SHOT


@pytest.mark.parametrize(
    ("kw", "outcome", "reason"),
    [
        ({"rld_decoding": False}, HandoffOutcome.FINISHED_ON_RLD, ""),
        ({"md_known": False}, HandoffOutcome.FAILED, "no_md_configured"),
        ({"md_holds_kv": False}, HandoffOutcome.FAILED, "md_kv_not_loaded"),
        ({"generated": 63}, HandoffOutcome.FINISHED_ON_RLD, ""),  # one token left: RLD makes it
        ({"generated": 64}, HandoffOutcome.FINISHED_ON_RLD, ""),
        # RLD's end outranks what MD lacks: the router releases MD's copy, no failure to report
        ({"rld_decoding": False, "md_holds_kv": False}, HandoffOutcome.FINISHED_ON_RLD, ""),
    ],
)
def test_no_handoff_says_why(kw: dict[str, object], outcome: HandoffOutcome, reason: str) -> None:
    got = open_handoff(ask(**kw), POLICY)
    assert got == HandoffResult(outcome, reason)


def test_two_tokens_left_still_hand_over() -> None:
    assert isinstance(open_handoff(ask(generated=62), POLICY), HandoffDecision)


def test_md_level_with_rld_takes_over() -> None:
    race = CatchUpRace(rld_next=100)  # prompt of 100 tokens, RLD streamed none yet
    for pos in range(100, 110):
        race.rld_token(pos)  # RLD at 110 next
    assert race.md_token(105) is RaceVerdict.PENDING
    race.rld_token(110)
    assert race.md_token(109) is RaceVerdict.PENDING  # RLD moved on to 111
    assert race.md_token(110) is RaceVerdict.MD_CAUGHT_UP and race.handed_off
    # the verdict stands: RLD's stream ending after the switch (it was cancelled) changes nothing
    assert race.rld_ended(finished=True) is RaceVerdict.MD_CAUGHT_UP
    assert race.rld_token(111) is RaceVerdict.MD_CAUGHT_UP and race.rld_next == 111


def test_rld_finishing_first_ends_the_race_its_way() -> None:
    race = CatchUpRace(rld_next=10)
    race.rld_token(10)
    assert race.rld_ended(finished=True) is RaceVerdict.RLD_FINISHED and not race.handed_off
    assert race.md_token(50) is RaceVerdict.RLD_FINISHED  # MD's late tokens do not switch


def test_rld_lost_leaves_it_to_the_take_over_and_time_out_hands_over() -> None:
    lost = CatchUpRace(rld_next=10)
    assert lost.rld_ended(finished=False) is RaceVerdict.RLD_LOST and not lost.handed_off
    late = CatchUpRace(rld_next=10)
    late.rld_token(40)
    assert late.out_of_time() is RaceVerdict.OUT_OF_TIME and late.handed_off  # MD goes on alone
