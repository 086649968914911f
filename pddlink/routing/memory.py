"""What one router remembers between placements (``pddlink.routing.placement``): the round-robin
cursor, the MD each block hash went to (``prefix_hash``) and the blocks each P prefilled (the P
choice of the prefix-minded policies). Sans-I/O, bounded LRU maps; one per router (and per
simulated deployment), never shared: another router's requests are not in it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pddlink.errors import ConfigError


class PlacementMemory:
    """What one router remembers between placements: the round-robin cursor, for
    ``prefix_hash`` which MD each block hash was last sent to, and which block hashes each P
    prefilled (each bounded, least recently used first out). Sans-I/O; one per router, never
    shared."""

    def __init__(self, capacity_blocks: int = 1_000_000) -> None:
        if capacity_blocks < 1:
            raise ConfigError(f"placement memory: capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._cursor = 0
        self._sent: OrderedDict[int, str] = OrderedDict()
        self._prefilled: OrderedDict[tuple[str, int], None] = OrderedDict()  # (P, block hash)

    def next_turn(self, n: int) -> int:
        turn = self._cursor % n
        self._cursor += 1
        return turn

    def remembered(self, hashes: Sequence[int]) -> tuple[str, int] | None:
        """The MD the deepest remembered block of ``hashes`` went to, and that depth in blocks."""
        for depth in range(len(hashes), 0, -1):
            md = self._sent.get(hashes[depth - 1])
            if md is not None:
                return md, depth
        return None

    def remember(self, hashes: Sequence[int], md: str) -> None:
        sent = self._sent
        for h in hashes:
            sent[h] = md
            sent.move_to_end(h)
        while len(sent) > self.capacity_blocks:
            sent.popitem(last=False)

    def prefilled_depth(self, p: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this router last had ``p`` prefill (its cache's
        likely hold: what a P prefilled stays in its prefix cache until evicted)."""
        for depth in range(len(hashes), 0, -1):
            if (p, hashes[depth - 1]) in self._prefilled:
                return depth
        return 0

    def prefilled(self, p: str, hashes: Sequence[int]) -> None:
        done = self._prefilled
        for h in hashes:
            done[(p, h)] = None
            done.move_to_end((p, h))
        while len(done) > self.capacity_blocks:
            done.popitem(last=False)

    def forget(self, md: str) -> None:
        """``md`` left the fleet (restarted with an empty cache, or removed)."""
        for h in [h for h, m in self._sent.items() if m == md]:
            del self._sent[h]

    def __len__(self) -> int:
        return len(self._sent)
