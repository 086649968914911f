"""PrefixIndex: hand-picked cases the model test may take long to find, and input refusals."""

from __future__ import annotations

import pytest

from pddlink.drc import BlocksRemoved, BlocksStored, IndexCleared, PrefixIndex
from pddlink.errors import InvalidInput, NotFound
from pddlink.kv.hashing import BlockHasher

HASHER = BlockHasher("index-test", block_size=2)


def seq(*tokens: int) -> list[int]:
    return HASHER.hash_blocks([t for tok in tokens for t in (tok, tok)])


def removed(events: list[object]) -> list[int]:
    return [h for ev in events if isinstance(ev, BlocksRemoved) for h in ev.hashes]


def test_recency_of_a_parent_includes_its_evicted_children() -> None:
    # P=(0) is stored at t1 and used through its child c=(0,0) at t3; X=(1) is used at t2.
    # Once c is evicted, P counts as used at t3, so X (t2) goes first.
    index = PrefixIndex(capacity_blocks=10)
    index.insert(seq(0, 0), now=1)
    index.insert(seq(1), now=2)
    (x,) = seq(1)
    index.pin(x)
    index.access(seq(0, 0), now=3)
    assert removed(index.evict(1, now=4)) == [seq(0, 0)[1]]
    index.unpin(x)
    assert removed(index.evict(1, now=5)) == [x]
    assert seq(0)[0] in index


def test_insert_stores_only_what_fits_beside_pinned_blocks() -> None:
    index = PrefixIndex(capacity_blocks=3)
    index.insert(seq(5, 6), now=0)
    index.pin(seq(5, 6)[-1])
    events = index.insert(seq(7, 8, 9), now=1)
    assert [type(e) for e in events] == [BlocksStored]
    assert events[0].hashes == tuple(seq(7))
    assert len(index) == 3
    index.pin(seq(7)[0])
    assert index.insert(seq(9), now=2) == []  # no room at all: nothing stored, no event
    assert index.match(seq(7, 8)).matched_blocks == 1


def test_insert_never_evicts_the_prefix_it_extends() -> None:
    index = PrefixIndex(capacity_blocks=2)
    index.insert(seq(1), now=0)  # the only (and least recent) leaf
    events = index.insert(seq(1, 2, 3), now=1)
    assert removed(events) == []
    assert index.match(seq(1, 2, 3)).matched_blocks == 2


def test_events_are_numbered_and_removal_comes_first() -> None:
    index = PrefixIndex(capacity_blocks=2, epoch=9)
    first = index.insert(seq(1, 2), now=0)
    second = index.insert(seq(3), now=1)
    assert [(type(e), e.seq, e.epoch) for e in first + second] == [
        (BlocksStored, 1, 9),
        (BlocksRemoved, 2, 9),
        (BlocksStored, 3, 9),
    ]
    assert second[0].hashes == (seq(1, 2)[1],)
    assert second[1].parent is None
    (cleared,) = index.clear(now=2)
    assert isinstance(cleared, IndexCleared) and cleared.seq == 4 and len(index) == 0


def test_refuses_bad_input_without_changing_state() -> None:
    index = PrefixIndex(capacity_blocks=4)
    index.insert(seq(1, 2), now=0)
    before = list(index.blocks())
    a, b = seq(1, 2)
    with pytest.raises(InvalidInput):
        index.insert([a, b, a], now=1)  # not a chain (a block repeats)
    with pytest.raises(InvalidInput):
        index.insert([b, a], now=1)  # cached blocks, wrong order
    with pytest.raises(InvalidInput):
        index.evict(-1, now=1)
    with pytest.raises(NotFound):
        index.pin(seq(4)[0])
    with pytest.raises(InvalidInput):
        index.unpin(a)
    with pytest.raises(InvalidInput):
        PrefixIndex(capacity_blocks=0)
    assert list(index.blocks()) == before and index.seq == 1


def test_from_blocks_restores_structure_and_continues_numbering() -> None:
    index = PrefixIndex()
    index.insert(seq(1, 2, 3), now=0)
    index.insert(seq(1, 4), now=0)
    copy = PrefixIndex.from_blocks(index.blocks(), capacity_blocks=4, epoch=1, seq=index.seq)
    assert list(copy.blocks()) == list(index.blocks())
    assert copy.match(seq(1, 4, 4)).matched_blocks == 2
    events = copy.insert(seq(5), now=1)  # full: evicts a leaf, never an inner block
    assert [type(e) for e in events] == [BlocksRemoved, BlocksStored]
    assert [e.seq for e in events] == [3, 4] and len(copy) == 4
    assert removed(events)[0] in (seq(1, 2, 3)[2], seq(1, 4)[1])
    with pytest.raises(InvalidInput):
        PrefixIndex.from_blocks([(seq(1, 2)[1], seq(1)[0])])  # child before its parent


def test_forget_keeps_the_lru_age_a_dropped_leaf_gave_its_ancestors() -> None:
    """A use of a deep leaf counts for its ancestors too (kept lazily on the leaf); when the engine
    drops the middle of that chain, the ancestor left as a leaf must keep the leaf's age, so the
    next eviction takes the block really used least recently (hypothesis found this)."""
    hasher = BlockHasher("index-test", block_size=1)
    idx = PrefixIndex()
    a = hasher.hash_blocks([0, 0, 1])  # (0,), (0,0), (0,0,1)
    b = hasher.hash_blocks([1])
    list(idx.insert(a, 1.0))
    list(idx.insert(b, 1.0))  # b used after a's insert...
    idx.access(a, 1.0)  # ...and a used after b
    list(idx.forget([a[1]], 1.0))  # the engine drops (0,0) and (0,0,1); (0,) is a leaf again
    (removed,) = idx.evict(1, 1.0)
    assert removed.hashes == (b[0],)
