"""The JSON answers of the sidecar's DRC admin endpoints, built from an index (or a mirror).

- ``GET /drc/stats``  -> :func:`stats_json` (counters, gauges and the most shared prefixes)
- ``POST /drc/match`` with ``{"tokens": [...]}`` -> :func:`match_json` (read-only: no stats, no LRU)

``pddlink drc stats|match`` prints the same objects, from a running sidecar or a snapshot file.
Pure: plain dicts of JSON types in and out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Protocol

import numpy as np

from pddlink.drc.index import PrefixIndex
from pddlink.drc.prefix import PrefixMatch
from pddlink.drc.snapshot import parent_positions
from pddlink.errors import InvalidInput
from pddlink.kv.hashing import BlockHasher

MAX_MATCH_TOKENS = 1 << 22


class Matchable(Protocol):
    def match(self, hashes: Sequence[int]) -> PrefixMatch: ...


def hash_hex(block_hash: int | None) -> str | None:
    return None if block_hash is None else f"{block_hash:032x}"


def tree_shape(parent_at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block (parents first): its depth in blocks, its child count, the leaves at or below it.

    Vectorised: depth by pointer doubling (log2 of the depth passes), leaf counts pushed up one
    depth level at a time.
    """
    n = len(parent_at)
    children = np.bincount(parent_at[parent_at >= 0], minlength=n)
    depth, jump = np.ones(n, dtype=np.int64), parent_at.copy()
    while (live := np.flatnonzero(jump >= 0)).size:
        up = jump[live]
        depth[live] += depth[up]
        jump[live] = jump[up]
    leaves = (children == 0).astype(np.int64)
    by_depth = np.argsort(-depth, kind="stable")
    cuts = np.flatnonzero(np.diff(depth[by_depth])) + 1
    for level in np.split(by_depth, cuts):  # deepest level first
        below = level[parent_at[level] >= 0]
        np.add.at(leaves, parent_at[below], leaves[below])
    return depth, children, leaves


def top_prefixes(index: PrefixIndex, top: int) -> list[dict[str, Any]]:
    """The ``top`` prefixes shared by the most cached sequences (O(cached blocks), vectorised).

    A prefix here ends where the tree branches or at a leaf; ``sequences`` counts the leaves below
    it (distinct cached continuations), ``blocks`` is its length. Ties go to the longer prefix,
    then to the one cached first.
    """
    if top <= 0 or len(index) == 0:
        return []
    hashes, parent_at = parent_positions(index)
    depth, children, leaves = tree_shape(parent_at)
    ends = np.flatnonzero(children != 1)
    ranked = ends[np.lexsort((-depth[ends], -leaves[ends]))][:top]
    return [
        {"tip": hash_hex(hashes[i]), "blocks": int(depth[i]), "sequences": int(leaves[i])}
        for i in ranked.tolist()
    ]


def stats_json(index: PrefixIndex, *, top: int = 5, block_size: int | None = None) -> dict[str, Any]:
    """``GET /drc/stats``: the index's :class:`DrcStats` plus hit rate and top prefixes."""
    stats = index.stats()
    answer: dict[str, Any] = asdict(stats)
    answer["hit_rate"] = stats.hit_rate
    answer["block_size"] = block_size
    answer["top_prefixes"] = top_prefixes(index, top)
    return answer


def parse_match_request(body: object) -> list[int]:
    """The token ids of a ``{"tokens": [int, ...]}`` request; refuses anything else."""
    if not isinstance(body, dict) or set(body) != {"tokens"}:
        raise InvalidInput('match request must be a JSON object {"tokens": [int, ...]}')
    tokens = body["tokens"]
    if not isinstance(tokens, list) or len(tokens) > MAX_MATCH_TOKENS:
        raise InvalidInput(f'"tokens" must be a list of at most {MAX_MATCH_TOKENS} token ids')
    if not all(type(t) is int and 0 <= t < 2**32 for t in tokens):
        raise InvalidInput('"tokens" must hold ints in [0, 2**32)')
    return tokens


def match_json(
    cache: Matchable, hasher: BlockHasher, body: object, *, parent: int | None = None
) -> dict[str, Any]:
    """``POST /drc/match``: how much of the prompt ``body["tokens"]`` is cached (read-only).

    ``parent``: chain root to hash from when it is not ``hasher.root`` (a snapshot's recorded root).
    """
    tokens = parse_match_request(body)
    hashes = hasher.hash_blocks(tokens, parent=parent)
    found = cache.match(hashes)
    return {
        "prompt_tokens": len(tokens),
        "block_size": hasher.block_size,
        "total_blocks": found.total_blocks,
        "matched_blocks": found.matched_blocks,
        "matched_tokens": found.matched_blocks * hasher.block_size,
        "hit_ratio": found.hit_ratio,
        "tip": hash_hex(found.tip),
    }
