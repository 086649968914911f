"""Event and snapshot byte forms: round trips, golden bytes, and typed refusals of bad bytes."""

from __future__ import annotations

import contextlib

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pddlink.drc import (
    BlocksRemoved,
    BlocksStored,
    EventDecodeError,
    IndexCleared,
    PrefixIndex,
    SnapshotError,
    decode_event,
    decode_snapshot,
    encode_event,
    encode_snapshot,
)
from pddlink.errors import InvalidInput
from pddlink.kv.hashing import BlockHasher

hashes = st.integers(0, 2**128 - 1)
events = st.one_of(
    st.builds(
        BlocksStored,
        st.integers(0, 2**64 - 1),
        st.integers(1, 2**64 - 1),
        st.none() | hashes,
        st.lists(hashes, min_size=1, max_size=5).map(tuple),
    ),
    st.builds(BlocksRemoved, st.integers(0, 9), st.integers(1, 9), st.lists(hashes, min_size=1).map(tuple)),
    st.builds(IndexCleared, st.integers(0, 9), st.integers(1, 9)),
)


@given(events)
def test_event_round_trip_and_every_truncation_is_refused(event: BlocksStored) -> None:
    data = encode_event(event)
    assert decode_event(data) == event
    for cut in range(len(data)):
        with pytest.raises(EventDecodeError):
            decode_event(data[:cut])


@settings(max_examples=200)
@given(st.binary(max_size=80))
def test_event_decoder_raises_only_typed_errors(data: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_event(data)


def test_event_golden_bytes() -> None:
    ev = BlocksStored(epoch=2, seq=3, parent=1, hashes=(0xAB,))
    assert encode_event(ev).hex() == (
        "01" "01" "0200000000000000" "0300000000000000" "01000000"
        + "00" * 15 + "01"
        + "00" * 15 + "ab"
    )  # fmt: skip


def test_events_validate_on_construction() -> None:
    with pytest.raises(InvalidInput):
        BlocksStored(1, 0, None, (1,))  # seq starts at 1
    with pytest.raises(InvalidInput):
        BlocksRemoved(1, 1, ())
    with pytest.raises(InvalidInput):
        BlocksStored(1, 1, None, (2**128,))


def build_index() -> PrefixIndex:
    hasher = BlockHasher("snap", block_size=2)
    index = PrefixIndex(capacity_blocks=50, epoch=77)
    for n in range(12):
        index.insert(hasher.hash_blocks([n % 3, n % 5] * (n + 1)), now=float(n))
    return index


def test_snapshot_round_trip_is_compact() -> None:
    index = build_index()
    data = encode_snapshot(index, block_size=2, root=0x1234)
    snap = decode_snapshot(data)
    assert (snap.epoch, snap.seq, snap.block_size, snap.root) == (77, index.seq, 2, 0x1234)
    assert list(snap.to_index(capacity_blocks=50).blocks()) == list(index.blocks())
    assert len(data) < 16 * len(index) + 120  # hashes plus a small header and compressed links


def test_snapshot_refuses_damaged_bytes() -> None:
    data = encode_snapshot(build_index())
    for bad in (data[:10], b"XDRC" + data[4:], data[:-1], data + b"\0"):
        with pytest.raises(SnapshotError):
            decode_snapshot(bad)
    header = 4 + 1 + 1 + 4 + 8 + 8 + 8 + 16 + 8
    with pytest.raises(SnapshotError):  # damaged compressed links
        decode_snapshot(data[:header] + bytes(len(data) - header))


@settings(max_examples=100)
@given(st.binary(max_size=120))
def test_snapshot_decoder_raises_only_typed_errors(data: bytes) -> None:
    with contextlib.suppress(SnapshotError):
        decode_snapshot(b"PDRC\x01\x00" + data)
