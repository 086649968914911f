"""MD's DRC follows vLLM's own prefix cache through vLLM's KV-cache events.

vLLM (started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "ipc:///.../md-events.ipc"}'``) publishes batches of ``BlockStored`` (block hashes,
parent hash, token ids), ``BlockRemoved`` (hashes) and ``AllBlocksCleared`` on a ZMQ PUB socket.
``KvEventFeed`` subscribes and replays them into a ``PrefixIndex`` keyed by pddlink's own chained
block hashes (what P sends in ``Reserve``): a stored block's pddlink hash is computed from its
token ids and its parent's pddlink hash, so both sides agree without sharing vLLM's hash seed.
The index has no capacity of its own: vLLM evicts, the index forgets (a removed block takes the
blocks below it along, as in vLLM, where they can no longer match).

A block whose parent is unknown (stored before the feed subscribed) is not indexed: the DRC then
answers a shorter prefix than vLLM holds and P ships a little more; never the other way round.
Events from other media (CPU offload tiers) are ignored.

A restarted vLLM is a new publisher on the same endpoint (the subscriber reconnects by itself): its
sequence numbers start over, so a batch numbered at or below the last one seen means a new engine,
whose cache starts empty: the index is cleared before the batch is applied. When the sidecar learns
of its engine's death first (``engine_lost``), the index is cleared then, and batches that continue
the dead publisher's sequence for ``STALE_S`` after it (queued in the subscriber before the kill)
are ignored rather than re-inserting blocks nobody holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from pddlink.drc import PrefixIndex
from pddlink.kv.hashing import BlockHasher

log = logging.getLogger("pddlink.vllm.events")

STALE_S = 2.0  # a restarted vLLM takes far longer than this to publish again


class KvEventFeed:
    def __init__(self, index: PrefixIndex, *, model_id: str, block_size: int) -> None:
        self.index = index
        self.hasher = BlockHasher(model_id, block_size)
        self.block_size = block_size
        self._ours: dict[Any, int] = {}  # vLLM block hash -> pddlink block hash
        self._task: asyncio.Task[None] | None = None
        self.counts = {"batches": 0, "stored": 0, "removed": 0, "cleared": 0, "orphans": 0, "gaps": 0}
        self.counts |= {"restarts": 0, "engine_lost": 0, "stale": 0}
        self._seq: int | None = None
        self._stale_until = 0.0
        self.last_event_at = 0.0
        self.error = ""

    def start(self, endpoint: str) -> None:
        self._task = asyncio.ensure_future(self._run(endpoint))
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.error = repr(task.exception())
            log.error("vLLM KV event feed ended: %s", self.error)

    async def _run(self, endpoint: str) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            while True:
                _topic, seq_bytes, payload = await sock.recv_multipart()
                if self.accept(int.from_bytes(seq_bytes, "big"), time.monotonic()):
                    self.apply(decoder.decode(payload).events)
        finally:
            sock.close()
            ctx.term()

    def accept(self, seq: int, now: float) -> bool:
        """Whether batch ``seq`` is to be applied: False for the dead engine's, still queued."""
        last, self._seq = self._seq, seq
        if last is not None and seq <= last:  # a new publisher: a new engine, an empty cache
            self._forget(now)
            self.counts["restarts"] += 1
            self._stale_until = 0.0
            return True
        if now < self._stale_until:
            self.counts["stale"] += 1
            return False
        if last is not None and seq != last + 1:
            self.counts["gaps"] += 1  # lost batches: the DRC may lag; vLLM stays the truth
        return True

    def engine_lost(self, now: float) -> None:
        """The engine died: its blocks are gone; what its publisher left queued is ignored."""
        self._forget(now)
        self.counts["engine_lost"] += 1
        self._stale_until = now + STALE_S

    def _forget(self, now: float) -> None:
        self._ours.clear()
        self.index.clear(now)

    def apply(self, events: list[Any]) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        now = time.monotonic()
        self.counts["batches"] += 1
        self.last_event_at = now
        for ev in events:
            if getattr(ev, "medium", None) not in (None, "GPU"):
                continue
            if isinstance(ev, BlockStored):
                self._stored(ev, now)
            elif isinstance(ev, BlockRemoved):
                gone = [self._ours.pop(h) for h in ev.block_hashes if h in self._ours]
                self.counts["removed"] += len(ev.block_hashes)
                if gone:
                    self.index.forget(gone, now)
            elif isinstance(ev, AllBlocksCleared):
                self._ours.clear()
                self.index.clear(now)
                self.counts["cleared"] += 1

    def _stored(self, ev: Any, now: float) -> None:
        bs = ev.block_size or self.block_size
        parent: int | None = None
        if ev.parent_block_hash is not None:
            parent = self._ours.get(ev.parent_block_hash)
            if parent is None or parent not in self.index:
                self.counts["orphans"] += len(ev.block_hashes)
                return
        chain = self._chain_to(parent)
        for i, vh in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * bs : (i + 1) * bs]
            if len(tokens) < bs:
                break
            ours = self.hasher.hash_blocks(tokens, parent=parent)[0]
            self._ours[vh] = ours
            chain.append(ours)
            parent = ours
        self.index.insert(chain, now)
        self.counts["stored"] += len(ev.block_hashes)

    def _chain_to(self, tip: int | None) -> list[int]:
        chain: list[int] = []
        while tip is not None:
            chain.append(tip)
            tip = self.index.parent_of(tip)
        chain.reverse()
        return chain

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "blocks": len(self.index), "mapped": len(self._ours), "error": self.error}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
