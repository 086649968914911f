"""Stream merging: any interleaving of RLD and MD streams yields each position once, in order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import InvalidInput
from pddlink.handoff import StreamMerger


def test_gap_waits_and_duplicate_dropped() -> None:
    m = StreamMerger(base_position=5, max_tokens=4)
    assert m.offer(6, 11, "md") == []
    out = m.offer(5, 10, "rld")
    assert [(t.position, t.token_id, t.source) for t in out] == [(5, 10, "rld"), (6, 11, "md")]
    assert m.offer(5, 10, "md") == [] and m.duplicates == 1 and m.divergences == 0
    assert m.offer(6, 99, "rld") == [] and m.divergences == 1
    m.offer(7, 12, "md")
    out = m.offer(8, 13, "md")
    assert [t.token_id for t in out] == [13] and m.finished
    assert m.offer(9, 14, "md") == []
    assert m.emitted == [10, 11, 12, 13] and m.by_source == {"rld": 1, "md": 3}


def test_last_marks_end() -> None:
    m = StreamMerger(base_position=1, max_tokens=100)
    m.offer(1, 3, "md", last=True)
    assert m.finished and m.offer(2, 4, "md") == []


def test_position_before_base_refused() -> None:
    m = StreamMerger(base_position=5, max_tokens=4)
    with pytest.raises(InvalidInput):
        m.offer(4, 1, "md")
    assert m.generated == 0


@given(
    n=st.integers(1, 60),
    split=st.integers(0, 60),
    overlap=st.integers(0, 10),
    order=st.randoms(use_true_random=False),
)
def test_two_overlapping_streams_merge_exactly(n: int, split: int, overlap: int, order: object) -> None:
    import random

    assert isinstance(order, random.Random)
    truth = [(i * 7919) % 1000 for i in range(n)]
    split = min(split, n)
    rld = [(100 + i, truth[i], "rld") for i in range(min(n, split + overlap))]
    md = [(100 + i, truth[i], "md") for i in range(max(0, split - overlap), n)]
    # each stream is in order; the two interleave arbitrarily
    merged: list[int] = []
    m = StreamMerger(base_position=100, max_tokens=n)
    queues = [list(rld), list(md)]
    while any(queues):
        q = order.choice([q for q in queues if q])
        pos, tok, src = q.pop(0)
        merged += [t.token_id for t in m.offer(pos, tok, src)]
    assert merged == truth and m.finished and m.divergences == 0
    assert sum(m.by_source.values()) == n
