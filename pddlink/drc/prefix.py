"""Prefix-match primitives shared by the index and the mirror: the answer types and the search.

``longest_cached_prefix`` relies on the set being closed under "parent of" (see ``index``): presence
along one hash chain is monotone, so a binary search finds the longest cached prefix.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a prompt: its first ``matched_blocks`` of ``total_blocks``."""

    matched_blocks: int
    total_blocks: int
    tip: int | None  # hash of the last matched block; None when nothing matched

    @property
    def missing_blocks(self) -> int:
        return self.total_blocks - self.matched_blocks

    @property
    def hit_ratio(self) -> float:
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class DrcStats:
    """Counters and gauges of one index (exported to Prometheus by the sidecar)."""

    epoch: int
    seq: int
    cached_blocks: int
    capacity_blocks: int | None  # None: unlimited
    pinned_blocks: int  # distinct pinned blocks (each also protects its prefix)
    reservations: int
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    inserted_blocks: int
    evicted_blocks: int
    leases_expired: int
    reservations_refused: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


def longest_cached_prefix(cached: Container[int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` are in ``cached``, by binary search (needs a prefix-closed set)."""
    n = len(hashes)
    if n == 0 or hashes[0] not in cached:
        return 0
    if hashes[n - 1] in cached:
        return n
    lo, hi = 0, n - 1  # hashes[lo] cached, hashes[hi] not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if hashes[mid] in cached:
            lo = mid
        else:
            hi = mid
    return hi
