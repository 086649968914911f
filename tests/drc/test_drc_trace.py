"""Replaying the Mooncake trace through the index reproduces directly computed prefix-hit rates.

Each 512-token block id of the trace becomes one 2-token block ``(id mod 2**32, id >> 32)``: the same
id always gives the same tokens, so shared leading ids stay shared prefixes, and chained hashing does
the rest. The direct computation below knows nothing of hashes: a plain trie of id sequences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pddlink.drc import PrefixIndex
from pddlink.kv.hashing import BlockHasher

# the project's shared folder: beside the checkout (/work/<checkout>), or /work/shared for a clone
# elsewhere (CI clones into a temporary directory)
_NAME = Path("shared") / "traces" / "mooncake-synthetic.jsonl"
TRACE = next(
    (p for p in (Path(__file__).resolve().parents[3] / _NAME, Path("/work") / _NAME) if p.exists()),
    Path("/work") / _NAME,
)
HASHER = BlockHasher("mooncake-trace", block_size=2)


@pytest.fixture(scope="module")
def requests() -> list[list[int]]:
    if not TRACE.exists():
        pytest.skip(f"trace not found at {TRACE}")
    with TRACE.open() as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


@pytest.fixture(scope="module")
def chains(requests: list[list[int]]) -> list[list[int]]:
    return [HASHER.hash_blocks([t for i in ids for t in (i & 0xFFFFFFFF, i >> 32)]) for ids in requests]


def direct_hits(requests: list[list[int]]) -> list[int]:
    """Per request: leading blocks that some earlier request had as the same leading run."""
    trie: dict[int, dict] = {}  # type: ignore[type-arg]
    hits = []
    for ids in requests:
        node, k, matching = trie, 0, True
        for i in ids:
            if i not in node:
                matching = False
                node[i] = {}
            elif matching:
                k += 1
            node = node[i]
        hits.append(k)
    return hits


def replay(chains: list[list[int]], capacity: int | None) -> tuple[list[int], PrefixIndex]:
    index = PrefixIndex(capacity)
    hits = []
    for t, hashes in enumerate(chains):
        hits.append(index.access(hashes, now=float(t)).matched_blocks)
        index.insert(hashes, now=float(t))
        assert capacity is None or len(index) <= capacity
    return hits, index


@pytest.fixture(scope="module")
def unlimited(chains: list[list[int]]) -> tuple[list[int], PrefixIndex]:
    return replay(chains, None)


def test_unlimited_capacity_reproduces_direct_hits(
    requests: list[list[int]], unlimited: tuple[list[int], PrefixIndex]
) -> None:
    expected = direct_hits(requests)
    hits, index = unlimited
    assert hits == expected
    total = sum(len(r) for r in requests)
    assert index.stats().hit_rate == pytest.approx(sum(expected) / total)
    ratios = [h / len(r) for h, r in zip(hits, requests, strict=True) if r]
    low, high = sum(x < 0.3 for x in ratios) / len(ratios), sum(x > 0.95 for x in ratios) / len(ratios)
    assert 0.45 < low < 0.65 and 0.2 < high < 0.4  # the bimodal shape the trace README describes
    assert len(index) == len({(tuple(r[: i + 1])) for r in requests for i in range(len(r))})


def test_capacity_limit_lowers_the_hit_rate(
    chains: list[list[int]], unlimited: tuple[list[int], PrefixIndex]
) -> None:
    unique = len(unlimited[1])
    rates = []
    for fraction in (0.5, 0.1, 0.02):
        hits, index = replay(chains, int(unique * fraction))
        rates.append(sum(hits) / sum(len(c) for c in chains))
        assert index.stats().evicted_blocks > 0
    full = sum(unlimited[0]) / sum(len(c) for c in chains)
    assert full > rates[0] > rates[1] > rates[2] > 0
