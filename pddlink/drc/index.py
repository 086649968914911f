"""The decode-side prefix index: which KV blocks MainDecode holds, as a tree of chained block hashes.

Theory of operation. A block hash (``pddlink.kv.hashing``) names its whole prefix, so the tree needs
no token lists and no per-node child maps: a node is a dict entry ``hash -> _Node(parent, ...)``. The
index only ever removes leaves, so the set of cached hashes stays closed under "parent of": if block
``i`` of a prompt is cached, so is every block before it. Presence along a prompt's hash chain is
therefore monotone (true ... true, false ... false), and :meth:`PrefixIndex.match` finds the longest
cached prefix by binary search: about ``log2(n)`` dict lookups (10 for a 64K-token prompt at 64-token
blocks) instead of ``n``. Precondition: the hashes passed in are one chain from the root, as
``BlockHasher.hash_blocks`` returns them.

Pins and eviction. A block with a cached child is never evicted, so pinning the deepest block of a
prefix protects the whole prefix: ``pin``/``unpin`` are O(1) reference counts on one node. Eviction
takes the least recently used unpinned leaf first. Recency is lazy: an access stamps only the deepest
block it used; when a leaf is evicted its stamp passes to its parent (``max``), so a block's stamp is
the latest use of anything at or below it, which is exactly LRU order among leaves. Evictable leaves
sit in a heap whose stale entries are skipped when popped.

Every change is returned as :mod:`~pddlink.drc.events` (numbered within the index's epoch); the
engine frees exactly the hashes of ``BlocksRemoved`` (``evict_prefix_blocks``). When the engine's
pool runs short and drops blocks on its own, :meth:`PrefixIndex.forget` removes them and what hangs
below them. Calls that take ``now`` first end the leases that ran out by then (see
:mod:`~pddlink.drc.leases`). Pure: no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

from pddlink.drc.events import BlocksRemoved, BlocksStored, Event, IndexCleared
from pddlink.drc.leases import LeaseBook, RefusalReason, Reservation, check_lease_args
from pddlink.drc.prefix import DrcStats, PrefixMatch, longest_cached_prefix
from pddlink.errors import InvalidInput, NotFound


class _Node:
    """One cached block. ``tick``: latest use at or below it (see the module docstring)."""

    __slots__ = ("children", "parent", "pins", "tick")

    def __init__(self, parent: int | None, tick: int, children: int) -> None:
        self.parent = parent
        self.tick = tick
        self.children = children
        self.pins = 0


class PrefixIndex:
    """LRU prefix cache over chained block hashes, within ``capacity_blocks`` (None: unlimited)."""

    def __init__(self, capacity_blocks: int | None = None, *, epoch: int = 0) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise InvalidInput(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        if not 0 <= epoch < 2**64:
            raise InvalidInput(f"epoch must be a u64, got {epoch}")
        self._capacity = capacity_blocks
        self._epoch = epoch
        self._seq = 0
        self._nodes: dict[int, _Node] = {}
        self._lru: list[tuple[int, int, int]] = []  # heap of (tick, order, hash) of evictable leaves
        self._tick = 0
        self._order = 0
        self._pinned = 0
        self._leases = LeaseBook()
        self._lookups = self._lookup_blocks = self._hit_blocks = 0
        self._inserted = self._evicted = 0

    @classmethod
    def from_blocks(
        cls,
        blocks: Iterable[tuple[int, int | None]],
        *,
        capacity_blocks: int | None = None,
        epoch: int = 0,
        seq: int = 0,
    ) -> PrefixIndex:
        """An index holding ``(hash, parent)`` blocks, parents first (a snapshot), all equally old."""
        index = cls(capacity_blocks, epoch=epoch)
        nodes = index._nodes
        for h, parent in blocks:
            if h in nodes or (parent is not None and parent not in nodes):
                raise InvalidInput("blocks must be distinct and listed after their parent")
            if parent is not None:
                nodes[parent].children += 1
            nodes[h] = _Node(parent, 0, 0)
        if capacity_blocks is not None and len(nodes) > capacity_blocks:
            raise InvalidInput(f"{len(nodes)} blocks exceed capacity_blocks={capacity_blocks}")
        index._seq = seq
        index._rebuild_lru()
        return index

    # -- reading -------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def seq(self) -> int:
        """Sequence number of the last event (0: none yet)."""
        return self._seq

    @property
    def capacity_blocks(self) -> int | None:
        return self._capacity

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._nodes

    def parent_of(self, block_hash: int) -> int | None:
        return self._node(block_hash).parent

    def pin_count(self, block_hash: int) -> int:
        return self._node(block_hash).pins

    def hashes_and_parents(self) -> tuple[list[int], list[int | None]]:
        """Every cached hash and its parent, parents before children (see :meth:`blocks`)."""
        return list(self._nodes), [node.parent for node in self._nodes.values()]

    def blocks(self) -> Iterator[tuple[int, int | None]]:
        """Every cached ``(hash, parent)``, parents before children."""
        # Dict order is insertion order; a parent is always inserted before its children and
        # outlives them, so insertion order is a topological order.
        for h, node in self._nodes.items():
            yield h, node.parent

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``hashes``. Read-only: no stats, no recency."""
        k = longest_cached_prefix(self._nodes, hashes)
        return PrefixMatch(k, len(hashes), hashes[k - 1] if k else None)

    def stats(self) -> DrcStats:
        return DrcStats(
            epoch=self._epoch,
            seq=self._seq,
            cached_blocks=len(self._nodes),
            capacity_blocks=self._capacity,
            pinned_blocks=self._pinned,
            reservations=len(self._leases),
            lookups=self._lookups,
            lookup_blocks=self._lookup_blocks,
            hit_blocks=self._hit_blocks,
            inserted_blocks=self._inserted,
            evicted_blocks=self._evicted,
            leases_expired=self._leases.expired_total,
            reservations_refused=self._leases.refused_total,
        )

    # -- using and changing --------------------------------------------------------------------

    def access(self, hashes: Sequence[int], now: float) -> PrefixMatch:
        """A request uses its cached prefix: counted in the hit statistics, refreshed for LRU."""
        self.handle_timer(now)
        found = self.match(hashes)
        self._lookups += 1
        self._lookup_blocks += found.total_blocks
        self._hit_blocks += found.matched_blocks
        if found.tip is not None:
            self._touch(found.tip, self._next_tick())
        return found

    def insert(self, hashes: Sequence[int], now: float) -> list[Event]:
        """Adds a finished sequence's blocks, evicting LRU leaves to make room.

        When pinned blocks leave too little room, only the leading blocks that fit are stored.
        Returns the events: ``BlocksRemoved`` (if anything was evicted) then ``BlocksStored``.
        """
        self.handle_timer(now)
        k = longest_cached_prefix(self._nodes, hashes)
        new = list(hashes[k:])
        if not self._is_chain(hashes, k, new):
            raise InvalidInput("hashes are not one block-hash chain from the root")
        tick = self._next_tick()
        parent = hashes[k - 1] if k else None
        if not new:
            if parent is not None:
                self._touch(parent, tick)
            return []
        room, removed = self._make_room(len(new), protect=parent)
        events = self._removed_events(removed)
        new = new[:room]
        if not new:
            if parent is not None:
                self._touch(parent, tick)
            return events
        self._link_chain(parent, new, tick)
        self._inserted += len(new)
        self._seq += 1
        events.append(BlocksStored(self._epoch, self._seq, parent, tuple(new)))
        return events

    def evict(self, max_blocks: int, now: float) -> list[Event]:
        """Evicts up to ``max_blocks`` LRU unpinned leaves (memory pressure from the engine)."""
        if max_blocks < 0:
            raise InvalidInput(f"max_blocks must be >= 0, got {max_blocks}")
        self.handle_timer(now)
        return self._removed_events(self._evict_lru(max_blocks))

    def forget(self, block_hashes: Iterable[int], now: float) -> list[Event]:
        """The engine dropped these blocks on its own (its pool ran short): remove them, and every
        block after them, which can no longer match. Leases pinning a removed block end (reason:
        evicted) and plain pins on one vanish. Returns one ``BlocksRemoved``, children before
        parents, whose hashes the owner frees in the engine too (the ones it still holds).

        Unknown hashes are ignored. Cost: one pass over the index, only when something is removed.
        """
        self.handle_timer(now)
        nodes = self._nodes
        gone = {h for h in block_hashes if h in nodes}
        if not gone:
            return []
        doomed: list[int] = []
        for h, node in nodes.items():  # insertion order is topological: parents come first
            if h in gone or node.parent in gone:
                gone.add(h)
                doomed.append(h)
        for rid in self._leases.ids():
            tip = self._leases.live(rid).tip
            if tip is not None and tip in gone:
                self._end_lease(rid, RefusalReason.EVICTED)
        for h in reversed(doomed):  # children before parents
            node = nodes.pop(h)
            if node.pins:
                self._pinned -= 1
            parent = node.parent
            if parent is None:
                continue
            up = nodes[parent]
            up.tick = max(up.tick, node.tick)  # a leaf's use is its ancestors' too (lazily kept)
            if parent not in gone:
                up.children -= 1
                if up.children == 0 and up.pins == 0:
                    self._push(parent, up.tick)
        self._evicted += len(doomed)
        return self._removed_events(list(reversed(doomed)))

    def pin(self, block_hash: int) -> None:
        """Protects ``block_hash`` and every block before it from eviction until :meth:`unpin`."""
        node = self._node(block_hash)
        if node.pins == 0:
            self._pinned += 1
        node.pins += 1

    def unpin(self, block_hash: int) -> None:
        node = self._node(block_hash)
        if node.pins == 0:
            raise InvalidInput(f"block {block_hash:032x} is not pinned")
        node.pins -= 1
        if node.pins == 0:
            self._pinned -= 1
            if node.children == 0:
                self._push(block_hash, node.tick)

    def clear(self, now: float) -> list[Event]:
        """Drops every block and ends every reservation (reason: cleared)."""
        for rid in self._leases.ids():
            self._leases.end(rid, RefusalReason.CLEARED)
        self._nodes.clear()
        self._lru.clear()
        self._pinned = 0
        self._seq += 1
        return [IndexCleared(self._epoch, self._seq)]

    # -- reservations (see pddlink.drc.leases) -------------------------------------------------

    def reserve(self, request_id: str, hashes: Sequence[int], lease_s: float, now: float) -> Reservation:
        """Pins the cached prefix of ``hashes`` for ``request_id`` until ``now + lease_s``."""
        check_lease_args(request_id, lease_s)
        self.handle_timer(now)
        if self._leases.is_live(request_id):
            raise self._leases.refuse(request_id, RefusalReason.DUPLICATE)
        found = self.access(hashes, now)
        if found.tip is not None:
            self.pin(found.tip)
        reservation = Reservation(
            request_id, found.matched_blocks, found.total_blocks, found.tip, now + lease_s
        )
        self._leases.add(reservation)
        return reservation

    def renew(self, request_id: str, lease_s: float, now: float) -> Reservation:
        check_lease_args(request_id, lease_s)
        self.handle_timer(now)
        renewed = replace(self._leases.live(request_id), expires_at_s=now + lease_s)
        self._leases.replace(renewed)
        return renewed

    def release(self, request_id: str, now: float) -> None:
        """The request was abandoned: drop its pin."""
        self.handle_timer(now)
        self._leases.live(request_id)
        self._end_lease(request_id, None)

    def commit(self, request_id: str, hashes: Sequence[int], now: float) -> list[Event]:
        """The request's KV is complete: insert its full sequence ``hashes`` and drop the pin."""
        self.handle_timer(now)
        held = self._leases.live(request_id)
        k = held.cached_blocks
        if k and (len(hashes) < k or hashes[k - 1] != held.tip):
            raise self._leases.refuse(request_id, RefusalReason.MISMATCH, "hashes do not extend it")
        events = self.insert(hashes, now)  # the reserved prefix stays pinned while room is made
        self._end_lease(request_id, None)
        return events

    def handle_timer(self, now: float) -> list[str]:
        """Ends the leases that ran out by ``now``; returns their request ids."""
        expired = self._leases.overdue(now)
        for rid in expired:
            self._end_lease(rid, RefusalReason.EXPIRED)
        return expired

    def reserved(self) -> list[str]:
        """The request ids holding a live reservation."""
        return self._leases.ids()

    def get_timer(self) -> float | None:
        """When the next lease runs out (None: no live lease)."""
        return self._leases.next_expiry()

    # -- internals -----------------------------------------------------------------------------

    def _node(self, block_hash: int) -> _Node:
        node = self._nodes.get(block_hash)
        if node is None:
            raise NotFound(f"block {block_hash:032x} is not cached")
        return node

    def _end_lease(self, request_id: str, how: RefusalReason | None) -> None:
        ended = self._leases.end(request_id, how)
        if ended.tip is not None:
            self.unpin(ended.tip)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _touch(self, block_hash: int, tick: int) -> None:
        node = self._nodes[block_hash]
        node.tick = tick
        if node.children == 0 and node.pins == 0:
            self._push(block_hash, tick)

    def _push(self, block_hash: int, tick: int) -> None:
        self._order += 1
        heapq.heappush(self._lru, (tick, self._order, block_hash))
        if len(self._lru) > 2 * len(self._nodes) + 64:
            self._rebuild_lru()

    def _rebuild_lru(self) -> None:
        self._lru = [
            (n.tick, i, h) for i, (h, n) in enumerate(self._nodes.items()) if not (n.children or n.pins)
        ]
        heapq.heapify(self._lru)

    def _make_room(self, wanted: int, protect: int | None) -> tuple[int, list[int]]:
        """Evicts so that ``wanted`` blocks fit, never ``protect``'s prefix: (room, evicted hashes)."""
        if self._capacity is None:
            return wanted, []
        removed: list[int] = []
        over = len(self._nodes) + wanted - self._capacity
        if over > 0:
            if protect is not None:
                self._nodes[protect].pins += 1
            removed = self._evict_lru(over)
            if protect is not None:
                self._nodes[protect].pins -= 1  # no push: it gets a child, or the caller touches it
        return min(wanted, self._capacity - len(self._nodes)), removed

    def _evict_lru(self, count: int) -> list[int]:
        removed: list[int] = []
        nodes, heap = self._nodes, self._lru
        while len(removed) < count and heap:
            tick, _, h = heapq.heappop(heap)
            node = nodes.get(h)
            if node is None or node.children or node.pins or node.tick != tick:
                continue  # stale entry
            while True:  # unwind a chain: a parent left childless is often the next victim
                del nodes[h]
                removed.append(h)
                parent = node.parent
                if parent is None:
                    break
                up = nodes[parent]
                up.tick = max(up.tick, node.tick)
                up.children -= 1
                if up.children or up.pins:
                    break
                if len(removed) < count and (not heap or up.tick < heap[0][0]):
                    h, node = parent, up  # what a push and a pop would pick next, without them
                    continue
                self._push(parent, up.tick)
                break
        self._evicted += len(removed)
        return removed

    def _removed_events(self, removed: list[int]) -> list[Event]:
        if not removed:
            return []
        self._seq += 1
        return [BlocksRemoved(self._epoch, self._seq, tuple(removed))]

    def _is_chain(self, hashes: Sequence[int], k: int, new: list[int]) -> bool:
        """The cached part links up parent by parent and the rest is new and distinct."""
        nodes = self._nodes
        parent = None
        for h in hashes[:k]:
            if nodes[h].parent != parent:
                return False
            parent = h
        return len(set(new)) == len(new) and nodes.keys().isdisjoint(new)

    def _link_chain(self, parent: int | None, new: list[int], tick: int) -> None:
        nodes = self._nodes
        if parent is not None:
            nodes[parent].children += 1
        prev = parent
        for h in new:
            nodes[h] = _Node(prev, tick, 1)
            prev = h
        last = nodes[new[-1]]
        last.children = 0
        self._push(new[-1], tick)
