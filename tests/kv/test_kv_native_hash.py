"""The C fast path of block hashing gives exactly the pure-Python path's hashes and typed errors.

The pure-Python path (``hash_block_bytes(token_buffer(ids))``) is the reference; tests/kv/test_hashing.py
checks it against the scheme's definition. Everything here except the build check skips where the
extension was not built; ``make test`` (CI) sets PDDLINK_REQUIRE_NATIVE=1, and then a missing
extension fails instead of skipping.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterator

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from pddlink.errors import InvalidInput
from pddlink.kv import hashing
from pddlink.kv.hashing import MAX_BLOCK_SIZE, BlockHasher, token_buffer

try:
    from pddlink.kv._native_hash import chain_u32
except ImportError:
    chain_u32 = None  # type: ignore[assignment]

needs_native = pytest.mark.skipif(
    chain_u32 is None,
    reason="pddlink.kv._native_hash is not built (needs a C compiler and libxxhash-dev at install time)",
)
RANGE_ERROR = "token ids must be ints in [0, 2**32)"
EDGES = [0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1]  # 2**30: where CPython ints get a second digit
token_id = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from(EDGES), st.integers(0, 200))
parents = st.one_of(st.none(), st.integers(0, 2**128 - 1), st.sampled_from([0, 2**128 - 1]))


def python_path(hasher: BlockHasher, ids: object, parent: int | None = None) -> list[int]:
    return hasher.hash_block_bytes(token_buffer(ids), parent)  # type: ignore[arg-type]


def test_extension_is_built_where_setup_ran() -> None:
    if os.environ.get("PDDLINK_REQUIRE_NATIVE") != "1":
        pytest.skip("PDDLINK_REQUIRE_NATIVE is not set (make test sets it after scripts/setup.sh)")
    assert chain_u32 is not None and hashing.NATIVE, (
        "scripts/setup.sh ran but pddlink.kv._native_hash was not built: install a C compiler and "
        "libxxhash-dev, then `pip install -e .`"
    )


def test_native_flag_says_which_path_lists_take() -> None:
    assert hashing.NATIVE is (chain_u32 is not None)


@needs_native
@given(st.lists(token_id, max_size=70), st.integers(1, 9), parents)
def test_same_hashes_as_the_python_path(ids: list[int], block: int, parent: int | None) -> None:
    hasher = BlockHasher("m", block, tenant_salt="t")
    expected = python_path(hasher, ids, parent)
    assert len(expected) == len(ids) // block  # a trailing partial block has no hash
    assert hasher.hash_blocks(ids, parent) == expected
    assert hasher.hash_blocks(tuple(ids), parent) == expected
    assert chain_u32(ids, block, hasher._parent_digest(parent)) == expected


@needs_native
def test_a_64k_token_prompt_and_a_block_larger_than_the_prompt() -> None:
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 2**32, size=65536 + 5, dtype=np.uint64).tolist()
    for block in (1, 64, 65536, 70000):
        hasher = BlockHasher("big", block)
        assert hasher.hash_blocks(ids) == python_path(hasher, ids)
    assert BlockHasher("big", 70000).hash_blocks(ids) == []
    assert BlockHasher("big", 4).hash_blocks([]) == []


class Token(int):
    """An int subclass, read like array('I') reads it: by value, not through __index__."""

    def __index__(self) -> int:
        return 0


@needs_native
def test_bools_int_subclasses_and_other_integers_as_in_the_python_path() -> None:
    hasher = BlockHasher("m", 2)
    for ids in ([True, False, Token(5), 7], [np.int64(3), 4, np.uint32(2**32 - 1), 1], [1, 2, np.int8(3)]):
        assert hasher.hash_blocks(ids) == python_path(hasher, ids)  # type: ignore[arg-type]
    # numpy integers are not Python ints: the extension hands them back to the Python path
    assert chain_u32([1, np.int64(2)], 2, bytes(16)) is None  # type: ignore[list-item]


class BadRepr(int):
    """An out-of-range id whose repr() fails: the error must not call it."""

    def __repr__(self) -> str:
        raise RuntimeError("repr called")


BAD_IDS = [-1, 2**32, 2**64, -(2**70), 2**100, 10**5000, BadRepr(2**40), "a", 1.5, None, b"\x01"]
BAD_IDS.append(np.float64(1.0))


@needs_native
@given(
    st.lists(st.integers(0, 1000), max_size=20),
    st.integers(0, 20),
    st.sampled_from(BAD_IDS),
    st.integers(1, 5),
)
def test_bad_ids_give_the_same_typed_error(ids: list[int], at: int, bad: object, block: int) -> None:
    tokens: list[object] = [*ids[:at], bad, *ids[at:]]  # anywhere, trailing partial block included
    hasher = BlockHasher("m", block)
    with pytest.raises(InvalidInput) as from_python:
        python_path(hasher, tokens)
    for form in (tokens, tuple(tokens)):
        with pytest.raises(InvalidInput) as from_native:
            hasher.hash_blocks(form)  # type: ignore[arg-type]
        assert type(from_native.value) is type(from_python.value)
        assert str(from_native.value).startswith(RANGE_ERROR)
    assert str(from_python.value).startswith(RANGE_ERROR)


@needs_native
def test_the_range_error_names_the_position() -> None:
    with pytest.raises(InvalidInput, match=r"token id at index 3 is out of range"):
        BlockHasher("m", 2).hash_blocks([0, 1, 2, 2**32])


def test_block_sizes_are_bounded_and_a_block_longer_than_the_ids_hashes_nothing() -> None:
    for block in (MAX_BLOCK_SIZE + 1, 2**40, 2**63):
        with pytest.raises(InvalidInput, match="block_size"):
            BlockHasher("m", block)
    assert BlockHasher("m", MAX_BLOCK_SIZE).hash_blocks([1, 2, 3]) == []
    with pytest.raises(InvalidInput):  # the ids of a partial block are still checked
        BlockHasher("m", MAX_BLOCK_SIZE).hash_blocks([1, 2**32])


def test_sequence_subclasses_are_read_through_their_own_methods() -> None:
    class Shifted(tuple[int, ...]):
        def __getitem__(self, i: object) -> object:
            got = tuple.__getitem__(self, i)  # type: ignore[call-overload]
            return got + 1 if isinstance(got, int) else got

        def __iter__(self) -> Iterator[int]:
            return (tuple.__getitem__(self, i) + 1 for i in range(len(self)))

    hasher = BlockHasher("m", 2)
    assert hasher.hash_blocks(Shifted([1, 2, 3, 4])) == hasher.hash_blocks([2, 3, 4, 5])


@needs_native
def test_extension_refuses_misuse() -> None:
    with pytest.raises(TypeError):
        chain_u32(np.arange(4), 2, bytes(16))  # type: ignore[arg-type]
    for block, parent in ((0, bytes(16)), (-1, bytes(16)), (2, bytes(15)), (2, bytes(17))):
        with pytest.raises(ValueError):
            chain_u32([1, 2], block, parent)


@needs_native
def test_no_memory_is_kept_across_calls_on_success_or_error() -> None:
    ids, bad = list(range(4096)), [*range(4000), -1]
    hasher = BlockHasher("m", 16)

    def round_trip() -> None:
        hasher.hash_blocks(ids)
        with pytest.raises(InvalidInput):
            hasher.hash_blocks(bad)

    round_trip()  # warm caches and interned objects first
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            round_trip()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 200 calls"
