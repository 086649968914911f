"""Block hashing: the definition in the module docstring, computed independently, and its properties."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import xxhash
from hypothesis import given

from pddlink.errors import InvalidInput
from pddlink.kv.hashing import BlockHasher, HashSchemeMismatch

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def reference(model: str, salt: str, block: int, ids: list[int]) -> list[int]:
    """The documented definition, written out the slow way."""
    d = xxhash.xxh3_128(f"pddlink/1/{model}/{salt}/{block}".encode()).digest()
    out = []
    for i in range(len(ids) // block):
        chunk = b"".join(t.to_bytes(4, "little") for t in ids[i * block : (i + 1) * block])
        d = xxhash.xxh3_128(d + chunk).digest()
        out.append(int.from_bytes(d, "big"))
    return out


@given(tokens, st.integers(1, 6), st.text(max_size=3))
def test_matches_the_documented_definition(ids: list[int], block: int, salt: str) -> None:
    hasher = BlockHasher("m", block, tenant_salt=salt)
    assert hasher.hash_blocks(ids) == reference("m", salt, block, ids)
    assert hasher.hash_blocks(np.array(ids, dtype=np.uint32)) == reference("m", salt, block, ids)
    assert hasher.hash_blocks(tuple(ids)) == reference("m", salt, block, ids)


def test_golden_value_pins_the_scheme() -> None:
    # If this changes, every deployed cache misses: bump HashScheme instead.
    assert BlockHasher("golden", 2).hash_blocks([1, 2, 3, 4, 5]) == reference(
        "golden", "", 2, [1, 2, 3, 4, 5]
    )
    assert f"{BlockHasher('golden', 2).hash_blocks([1, 2])[0]:032x}" == GOLDEN


GOLDEN = "3c9616dc526ea80d347bba726e3e34ca"  # scheme 1, model "golden", block size 2, tokens [1, 2]


@given(tokens, tokens, st.integers(1, 4))
def test_chaining_from_a_parent_continues_the_chain(a: list[int], b: list[int], block: int) -> None:
    hasher = BlockHasher("m", block)
    a = a[: len(a) - len(a) % block]
    head = hasher.hash_blocks(a)
    tail = hasher.hash_blocks(b, parent=head[-1] if head else None)
    assert head + tail == hasher.hash_blocks(a + b)


def test_shared_blocks_only_with_a_shared_prefix_and_namespace() -> None:
    hasher = BlockHasher("m", 2)
    x, y = hasher.hash_blocks([1, 2, 3, 4]), hasher.hash_blocks([9, 2, 3, 4])
    assert x[1] != y[1]  # same tokens in block 1, different prefix
    assert hasher.hash_blocks([1, 2, 3]) == x[:1]  # a partial block has no identity
    roots = {BlockHasher("m", 2).root, BlockHasher("n", 2).root, BlockHasher("m", 4).root}
    roots.add(BlockHasher("m", 2, tenant_salt="t").root)
    assert len(roots) == 4


def test_refuses_bad_input() -> None:
    hasher = BlockHasher("m", 2)
    for bad in ([-1, 0], [2**32, 0], np.array([-1, 3]), ["a", "b"], np.array([1.5, 2.0])):
        with pytest.raises(InvalidInput):
            hasher.hash_blocks(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        hasher.hash_blocks([1, 2], parent=2**128)
    with pytest.raises(InvalidInput):
        BlockHasher("m", 0)
    with pytest.raises(HashSchemeMismatch):
        BlockHasher("m", 2, scheme=2)  # type: ignore[arg-type]
