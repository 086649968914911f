"""The decode side's prefix cache in the simulator: the real ``pddlink.drc.PrefixIndex``, one per instance.

The simulator's block ids are prefix-chained (as the DRC's block hashes are), so they are used as
the hashes directly. Lifecycle per request: ``matched_blocks`` while routing (the mirror's view;
read-only); ``reserve`` when the request is admitted (counts the hit, refreshes recency, pins the
matched prefix as P's reservation does); ``land`` when MD holds the prompt's KV (insert it, move the
pin to the whole prompt); ``release`` when the sequence finishes (unpin; the blocks stay cached).
"""

from __future__ import annotations

from collections.abc import Sequence

from pddlink.drc.index import PrefixIndex


class DecodeCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.index = PrefixIndex(capacity_blocks)

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        return self.index.match(hashes).matched_blocks

    def reserve(self, hashes: Sequence[int], now: float) -> int | None:
        """Pin the cached prefix of ``hashes``; returns the pinned block (None: nothing cached)."""
        tip = self.index.access(hashes, now).tip
        if tip is not None:
            self.index.pin(tip)
        return tip

    def land(self, hashes: Sequence[int], pinned: int | None, now: float) -> int | None:
        """Insert the prompt's blocks; the pin moves to the deepest block now cached."""
        tip = None
        if hashes:
            self.index.insert(hashes, now)
            # the index is prefix-closed: when the last block is cached, so is the whole prompt
            tip = hashes[-1] if hashes[-1] in self.index else self.index.match(hashes).tip
        if tip is not None:
            self.index.pin(tip)
        if pinned is not None:
            self.index.unpin(pinned)
        return tip

    def release(self, pinned: int | None) -> None:
        if pinned is not None:
            self.index.unpin(pinned)
