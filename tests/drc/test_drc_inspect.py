"""The admin JSON: top prefixes (vectorised) against a brute-force walk of the tree, stats keys."""

from __future__ import annotations

import random

import pytest

from pddlink.drc import PrefixIndex
from pddlink.drc.inspect import stats_json, top_prefixes
from pddlink.kv.hashing import BlockHasher

HASHER = BlockHasher("inspect-test", block_size=1)


def brute_force_top(index: PrefixIndex) -> list[tuple[str, int, int]]:
    blocks = dict(index.blocks())
    order = list(blocks)

    def ancestry(h: int | None) -> list[int]:
        path = []
        while h is not None:
            path.append(h)
            h = blocks[h]
        return path

    children = {h: sum(1 for c in order if blocks[c] == h) for h in order}
    leaves = [h for h in order if children[h] == 0]
    below = {h: sum(1 for leaf in leaves if h in ancestry(leaf)) for h in order}
    ends = [h for h in order if children[h] != 1]
    ends.sort(key=lambda h: (-below[h], -len(ancestry(h))))
    return [(f"{h:032x}", len(ancestry(h)), below[h]) for h in ends]


@pytest.mark.parametrize("seed", range(6))
def test_top_prefixes_match_a_brute_force_walk(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex(capacity_blocks=rng.choice([None, 40]))
    for t in range(60):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        index.insert(HASHER.hash_blocks(prompt), now=float(t))
    got = [(row["tip"], row["blocks"], row["sequences"]) for row in top_prefixes(index, top=10_000)]
    assert got == brute_force_top(index)
    assert top_prefixes(index, top=3) == top_prefixes(index, top=10_000)[:3]


def test_stats_json_keys_and_an_empty_index() -> None:
    answer = stats_json(PrefixIndex(capacity_blocks=8, epoch=4), block_size=16)
    assert answer["top_prefixes"] == [] and answer["cached_blocks"] == 0 and answer["hit_rate"] == 0.0
    assert {"epoch", "seq", "capacity_blocks", "evicted_blocks", "reservations", "block_size"} <= set(answer)
