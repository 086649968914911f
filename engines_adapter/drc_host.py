"""MD's DRC: the prefix index beside the engine's pool, reservations for P, events for mirrors.

Lifecycle: built by the MD sidecar with the engine's hasher and pool size. ``reserve`` answers P's
``Reserve`` (pins the cached prefix under a lease); ``commit`` records what the engine now holds
(the prompt after an import, the whole sequence at the end); evictions the index decides are
applied to the engine's pool, so the two stay aligned. The other way round too: blocks the engine's
pool dropped on its own (it ran short between two DRC calls) are forgotten by the index at the start
of every call, and what hung below them is freed in the engine, before anything is answered from
the index. Every change is published to subscribers
(the router's mirror) through ``subscribe()`` queues; ``snapshot()`` starts a new subscriber.

Threads: the index and the engine's pool change together, so every method except ``publish`` and
``subscribe`` runs in the engine's worker thread (``EngineLoop.call``); they return the events,
which the event loop then hands to ``publish``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from engines_adapter import EngineAdapter
from pddlink import metrics
from pddlink.drc import (
    BlocksRemoved,
    Event,
    PrefixIndex,
    RefusalReason,
    Reservation,
    ReservationRefused,
    encode_event,
    encode_snapshot,
)
from pddlink.kv.hashing import BlockHasher


class DrcHost:
    def __init__(self, engine: EngineAdapter, capacity_blocks: int) -> None:
        self.engine = engine
        layout = engine.layout
        self.hasher = BlockHasher(layout.model_id, layout.block_size)
        self.index = PrefixIndex(capacity_blocks, epoch=time.time_ns())
        self._subscribers: list[asyncio.Queue[bytes]] = []

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def reserve(
        self, request_id: str, hashes: Sequence[int], lease_s: float
    ) -> tuple[Reservation, list[Event]]:
        """Pins the cached prefix for P; also returns the events of the engine's own evictions,
        which are synced first so the answer never counts blocks the engine has dropped."""
        events = self.sync_engine()
        held = self.index.reserve(request_id, hashes, lease_s, self.now())
        metrics.DRC_LOOKUPS.inc()
        metrics.DRC_LOOKUP_BLOCKS.inc(held.total_blocks)
        metrics.DRC_HIT_BLOCKS.inc(held.cached_blocks)
        return held, events

    def release(self, request_id: str) -> RefusalReason | None:
        """Drop the request's pin. Returns why nothing was pinned any more (unknown, expired,
        cleared), or None when a live reservation was released."""
        try:
            self.index.release(request_id, self.now())
        except ReservationRefused as exc:
            return exc.reason
        return None

    def commit(self, request_id: str, tokens: Sequence[int]) -> list[Event]:
        """The engine holds KV for ``tokens`` (full blocks): record them, end the reservation."""
        hashes = self.hasher.hash_blocks(list(tokens))
        synced = self.sync_engine()
        try:
            events = self.index.commit(request_id, hashes, self.now())
        except ReservationRefused:  # lease gone (unknown, expired, cleared, evicted) or a
            events = self.index.insert(hashes, self.now())  # mismatch: still record what it holds
        return synced + self._apply_evictions(events)

    def insert(self, tokens: Sequence[int]) -> list[Event]:
        return self.insert_hashes(self.hasher.hash_blocks(list(tokens)))

    def insert_hashes(self, hashes: Sequence[int]) -> list[Event]:
        """``insert`` for a caller that has hashed the blocks already (with this model's hasher)."""
        synced = self.sync_engine()
        return synced + self._apply_evictions(self.index.insert(list(hashes), self.now()))

    def sync_engine(self) -> list[Event]:
        """Forget what the engine's pool dropped on its own; free in the engine what hung below it."""
        dropped = self.engine.drain_evicted_hashes()
        if not dropped:
            return []
        metrics.DRC_ENGINE_EVICTED_BLOCKS.inc(len(dropped))
        return self._apply_evictions(self.index.forget(dropped, self.now()))

    def expire(self) -> None:
        self.index.handle_timer(self.now())

    def _apply_evictions(self, events: list[Event]) -> list[Event]:
        for ev in events:
            if isinstance(ev, BlocksRemoved):
                self.engine.evict_prefix_blocks(list(ev.hashes))
        return events

    def publish(self, events: list[Event]) -> None:
        """Event-loop side: count and fan the events out to subscribers."""
        for ev in events:
            metrics.DRC_EVENTS.labels(kind=type(ev).__name__).inc()
            data = encode_event(ev)
            for q in self._subscribers:
                q.put_nowait(data)
        metrics.DRC_CACHED_BLOCKS.set(len(self.index))

    def subscribe(self) -> asyncio.Queue[bytes]:
        """A queue of encoded events from now on (take a ``snapshot`` first, in the engine thread)."""
        q: asyncio.Queue[bytes] = asyncio.Queue()
        self._subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[bytes]) -> None:
        if q in self._subscribers:
            self._subscribers.remove(q)

    def snapshot(self) -> bytes:
        return encode_snapshot(self.index, block_size=self.hasher.block_size, root=self.hasher.root)
