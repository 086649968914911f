"""A decoder's sequence in memory: inputs in any order, slices checked, one end, the cache rule."""

from __future__ import annotations

import pytest

from engines_adapter.base import SamplingParams
from pddlink.handoff import HandoffError, HandoffMode, HandoffSlice
from pddlink.lifecycle import DecodeSequence, SeqState, SliceStep, StreamClosed, StreamEnd
from pddlink.lifecycle.decode import ORPHAN_DEADLINE_S, SEQ_TRANSITIONS, handoff_refused
from pddlink.roles import Role

PROMPT = (5, 6, 7)
SAMPLING = SamplingParams(seed=1, max_tokens=4, stop_token_ids=(99,))


def seq(role: Role = Role.MD) -> DecodeSequence[bytes]:
    return DecodeSequence.orphan("r", role, now=10.0)


def slice_(first: int, ids: tuple[int, ...], final: bool = True) -> HandoffSlice:
    return HandoffSlice("r", first, ids, final, HandoffMode.ONE_SHOT)


def ready(role: Role = Role.MD) -> DecodeSequence[bytes]:
    s = seq(role)
    s.attach(PROMPT, SAMPLING, deadline=20.0)
    s.kv_arrived(b"kv")
    s.take_kv()
    s.import_done()
    return s


@pytest.mark.parametrize("order", ["attach_first", "kv_first"])
def test_import_starts_once_both_prompt_and_kv_are_here(order: str) -> None:
    s = seq()
    assert s.deadline == 10.0 + ORPHAN_DEADLINE_S
    if order == "attach_first":
        assert not s.attach(PROMPT, SAMPLING, deadline=20.0)
        assert s.kv_arrived(b"kv")
    else:
        assert not s.kv_arrived(b"kv")
        assert s.attach(PROMPT, SAMPLING, deadline=20.0)
    assert s.deadline == 20.0 and s.take_kv() == b"kv" and s.kv is None
    assert s.state is SeqState.IMPORTING and not s.imported
    assert not s.kv_arrived(b"again")  # a second transfer does not import twice
    s.import_done()
    assert s.state is SeqState.READY and s.imported


def test_a_slice_extends_then_the_final_one_starts_decoding() -> None:
    s = ready()
    assert s.on_slice(slice_(3, (40,), final=False), sender_finished=False) is SliceStep.EXTEND
    assert s.on_slice(slice_(4, (41,)), sender_finished=False) is SliceStep.EXTEND
    assert s.generated == [40, 41] and s.start_decoding() and s.state is SeqState.DECODING
    s.on_token(42, finished=False)
    s.on_token(43, finished=True)
    assert s.finished and s.generated == [40, 41, 42, 43]


def test_gap_or_overlap_is_refused_without_a_change() -> None:
    s = ready()
    with pytest.raises(HandoffError, match="gap"):
        s.on_slice(slice_(5, (1,)), sender_finished=False)
    with pytest.raises(HandoffError, match="overlap"):
        s.on_slice(slice_(2, (1,)), sender_finished=False)
    assert s.generated == [] and s.state is SeqState.READY


def test_a_complete_request_is_not_extended() -> None:
    s = ready()
    assert s.on_slice(slice_(3, (1, 2, 3, 4)), sender_finished=False) is SliceStep.COMPLETE  # max tokens
    assert s.finished and not s.start_decoding()
    stop = ready()
    assert stop.on_slice(slice_(3, (1, 99), final=False), sender_finished=False) is SliceStep.COMPLETE
    assert not stop.finished  # not final: the sender still has the last word


def test_sender_finished_means_release() -> None:
    assert ready().on_slice(slice_(3, (1,)), sender_finished=True) is SliceStep.RELEASE


def test_import_failure_refuses_slices_and_ends_failed() -> None:
    s = seq()
    s.attach(PROMPT, SAMPLING, deadline=20.0)
    s.kv_arrived(b"kv")
    s.take_kv()
    closed = s.import_failed("layout mismatch")
    assert closed == StreamClosed(StreamEnd.FAILED, "import_failed: layout mismatch")
    assert s.imported and s.refusal() == "import_failed: layout mismatch"
    plan = s.end(closed)
    assert (
        plan is not None
        and not plan.cache_prefix
        and s.render_end() == "failed:import_failed: layout mismatch"
    )


def test_end_happens_once_and_only_md_caches_a_clean_end() -> None:
    for role, closed, keep in [
        (Role.MD, StreamClosed(StreamEnd.FINISHED), True),
        (Role.MD, StreamClosed(StreamEnd.RELEASED), True),
        (Role.MD, StreamClosed(StreamEnd.FAILED, "deadline_exceeded"), False),
        (Role.RLD, StreamClosed(StreamEnd.FINISHED), False),
        (Role.RLD, StreamClosed(StreamEnd.HANDED_OFF), False),
    ]:
        s = ready(role)
        plan = s.end(closed)
        assert plan is not None and plan.cache_prefix is keep, (role, closed)
        assert s.end(StreamClosed(StreamEnd.RELEASED)) is None and s.closed == closed
        assert s.refusal() == f"request already ended ({closed.render()})"
        assert not s.kv_arrived(b"late")


def test_transitions_table_rejects_a_jump() -> None:
    s = seq()
    assert SeqState.DECODING not in SEQ_TRANSITIONS[SeqState.WAITING]
    with pytest.raises(AssertionError):
        s.start_decoding()


def test_start_handoff_for_a_request_no_longer_held() -> None:
    assert handoff_refused(StreamClosed(StreamEnd.FINISHED)).render() == "finished_on_rld"
    assert handoff_refused(None).render() == "failed:unknown_request"
    late = StreamClosed(StreamEnd.FAILED, "deadline_exceeded")
    assert handoff_refused(late).render() == "failed:failed:deadline_exceeded"


@pytest.mark.parametrize(
    "text", ["finished", "handed_off", "released", "failed:deadline_exceeded", "failed:import_failed: x: y"]
)
def test_stream_end_texts_round_trip(text: str) -> None:
    assert StreamClosed.parse(text).render() == text


def test_a_recompute_attach_imports_without_kv_and_a_late_kv_starts_nothing() -> None:
    s = seq()
    assert not s.attach(PROMPT, SAMPLING, deadline=20.0, recompute=True)
    assert s.state is SeqState.IMPORTING and not s.imported
    assert not s.kv_arrived(b"kv")  # MD prefills itself: a KV that still arrives is not imported
    s.import_done()
    assert s.state is SeqState.READY and s.imported
    assert s.on_slice(slice_(3, (40,)), sender_finished=False) is SliceStep.EXTEND
    assert s.start_decoding() and s.state is SeqState.DECODING
