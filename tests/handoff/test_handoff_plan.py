"""Handoff planner and intake: slices are contiguous, one-shot is one slice, catch-up ends level."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import InvalidInput
from pddlink.handoff import HandoffError, HandoffIntake, HandoffMode, HandoffPlan, HandoffSlice


def test_one_shot_sends_everything_in_one_final_slice() -> None:
    plan = HandoffPlan("r1", base_position=10, mode=HandoffMode.ONE_SHOT, slice_tokens=4)
    s = plan.next_slice([5, 6, 7, 8, 9, 1, 2])
    assert s is not None and s.final and s.first_position == 10 and s.token_ids == (5, 6, 7, 8, 9, 1, 2)
    assert plan.next_slice([5, 6, 7, 8, 9, 1, 2, 3]) is None
    plan.on_ack(17)
    assert plan.done


def test_catch_up_sends_full_slices_until_level() -> None:
    plan = HandoffPlan("r1", base_position=100, mode=HandoffMode.CATCH_UP, slice_tokens=4)
    gen = list(range(10))
    s1 = plan.next_slice(gen)
    assert s1 is not None and not s1.final and s1.token_ids == (0, 1, 2, 3)
    assert plan.next_slice(gen) is None  # one slice in flight at a time
    plan.on_ack(104)
    gen += [10, 11]
    s2 = plan.next_slice(gen)
    assert s2 is not None and (s2.first_position, s2.token_ids, s2.final) == (104, (4, 5, 6, 7), False)
    plan.on_ack(108)
    s3 = plan.next_slice(gen)
    assert s3 is not None and s3.final and s3.token_ids == (8, 9, 10, 11)
    plan.on_ack(112)
    assert plan.done


def test_wrong_ack_is_refused() -> None:
    plan = HandoffPlan("r1", base_position=3, mode=HandoffMode.ONE_SHOT)
    plan.next_slice([1, 2])
    with pytest.raises(HandoffError):
        plan.on_ack(4)
    assert not plan.done


@pytest.mark.parametrize(
    "kwargs",
    [{"base_position": 0}, {"slice_tokens": 0}],
)
def test_bad_plan_config(kwargs: dict[str, int]) -> None:
    args: dict[str, int] = {"base_position": 5, "slice_tokens": 4} | kwargs
    with pytest.raises(InvalidInput):
        HandoffPlan("r", mode=HandoffMode.CATCH_UP, **args)


def test_bad_slice() -> None:
    with pytest.raises(InvalidInput):
        HandoffSlice("r", 5, (), True, HandoffMode.ONE_SHOT)
    with pytest.raises(InvalidInput):
        HandoffSlice("r", 5, (-1,), True, HandoffMode.ONE_SHOT)


def test_intake_refuses_gap_and_overlap_without_state_change() -> None:
    intake = HandoffIntake("r", base_position=8)
    intake.accept(HandoffSlice("r", 8, (1, 2), False, HandoffMode.CATCH_UP))
    for bad in (
        HandoffSlice("r", 11, (3,), True, HandoffMode.CATCH_UP),
        HandoffSlice("r", 9, (3,), True, HandoffMode.CATCH_UP),
        HandoffSlice("x", 10, (3,), True, HandoffMode.CATCH_UP),
    ):
        with pytest.raises(HandoffError):
            intake.accept(bad)
    assert intake.next_position == 10 and not intake.finished
    assert intake.accept(HandoffSlice("r", 10, (3,), True, HandoffMode.CATCH_UP)) == (3,)
    with pytest.raises(HandoffError):
        intake.accept(HandoffSlice("r", 11, (4,), True, HandoffMode.CATCH_UP))


@given(
    base=st.integers(1, 500),
    slice_tokens=st.integers(1, 16),
    mode=st.sampled_from(list(HandoffMode)),
    bursts=st.lists(st.integers(0, 20), min_size=1, max_size=12),
)
def test_slices_reassemble_exactly(
    base: int, slice_tokens: int, mode: HandoffMode, bursts: list[int]
) -> None:
    """Whatever RLD's decode pace, MD receives every generated id once, contiguous, ending final."""
    plan = HandoffPlan("r", base_position=base, mode=mode, slice_tokens=slice_tokens)
    intake = HandoffIntake("r", base_position=base)
    gen: list[int] = [7]
    received: list[int] = []
    for burst in [*bursts, 10_000]:  # the last round: RLD keeps going until the plan says stop
        for _ in range(min(burst, 40)):
            if plan.final_sent:
                break
            gen.append(len(gen) * 3 % 101)
        s = plan.next_slice(gen)
        while s is not None:
            received.extend(intake.accept(s))
            plan.on_ack(s.end_position)
            if s.final:
                break
            gen.append(len(gen) % 13)
            s = plan.next_slice(gen)
        if plan.done:
            break
    assert plan.done and intake.finished
    assert received == gen[: len(received)]
    assert len(received) == len(gen)  # RLD stopped exactly where the final slice ended
