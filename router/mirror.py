"""The router's DRC mirror: follows MD's DRC event stream so that per-request choices read a local
copy (``Mirror``) and never wait on MD.

The first message of each stream is a snapshot (it also gives the block size and the hash root);
events follow. A gap the mirror cannot bridge, or MD going away, ends the stream; the follower
reconnects shortly and starts again from a snapshot.

``VllmMirror`` is the same view for vLLM's MD: MD vLLM's own KV-cache events replayed into a local
``PrefixIndex`` (the feed MD's vLLM sidecar uses, ``pddlink.connector.kv_events``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from pddlink.connector.kv_events import KvEventFeed
from pddlink.drc import Mirror, PrefixIndex, decode_event, decode_snapshot
from pddlink.kv.hashing import BlockHasher
from pddlink.serving.pb import pb2

RECONNECT_S = 0.5


class MirrorFollower:
    def __init__(self, md: Any) -> None:
        self.md = md
        self.mirror = Mirror(gap_timeout_s=2.0)
        self.hasher: BlockHasher | None = None
        self.root = 0
        self.last_error = ""  # why the DRC event stream from MD last broke

    async def follow(self) -> None:
        while True:
            try:
                async for batch in self.md.DrcEvents(pb2.DrcEventsRequest()):
                    self._apply(batch, time.monotonic())
                    if self.mirror.needs_resync:
                        break  # reconnect: the first message of a new stream is a snapshot
            except grpc.aio.AioRpcError as exc:  # MD restarting or unreachable: follow again shortly
                self.last_error = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(RECONNECT_S)

    def _apply(self, batch: Any, now: float) -> None:
        if batch.snapshot:
            snap = decode_snapshot(batch.snapshot)
            if self.hasher is None or snap.root != self.root:
                self.root = snap.root
                self.hasher = BlockHasher("router", max(1, snap.block_size))
            self.mirror.load_snapshot(snap, now)
        for data in batch.events:
            self.mirror.apply(decode_event(data), now)

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        if self.hasher is None:
            return 0
        hashes = self.hasher.hash_blocks(list(prompt), parent=self.root)
        return self.mirror.match(hashes).matched_blocks * self.hasher.block_size


class VllmMirror(KvEventFeed):
    """The router's mirror of MD's vLLM prefix cache, fed by MD vLLM's own KV-cache events (a second
    subscriber on its ZMQ publisher, beside MD's sidecar; ``pddlink.connector.kv_events``).

    It never answers a longer prefix than MD holds: blocks stored before it subscribed are orphans
    (not indexed, a shorter answer), and whatever may have been missed clears it: a gap in the
    publisher's sequence numbers (lost batches, or a restarted vLLM counting from 0 again) and MD
    found dead (``forget_all``, told by the backend's health watch). The block size is vLLM's own,
    learnt from the events (until the first one the mirror matches nothing)."""

    def __init__(self) -> None:
        super().__init__(PrefixIndex(), model_id="router-md-mirror", block_size=1)
        self.learnt = False  # block_size is vLLM's (from an event), not the placeholder
        self.endpoint = ""
        self._gaps_seen = 0
        self.resets = 0

    def start(self, endpoint: str) -> None:
        self.endpoint = endpoint
        super().start(endpoint)

    def apply(self, events: list[Any]) -> None:
        if self.counts["gaps"] != self._gaps_seen:
            self._gaps_seen = self.counts["gaps"]
            self.forget_all()
        super().apply(events)

    def _stored(self, ev: Any, now: float) -> None:
        if ev.block_size and (not self.learnt or ev.block_size != self.block_size):
            self.forget_all()  # (first event) vLLM's block size: what the prompts are cut into
            self.block_size, self.learnt = int(ev.block_size), True
            self.hasher = BlockHasher("router-md-mirror", self.block_size)
        super()._stored(ev, now)

    def forget_all(self) -> None:
        if len(self.index) or self._ours:
            self.resets += 1
        self._ours.clear()
        self.index.clear(time.monotonic())

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        if not self.learnt or len(prompt) < self.block_size:
            return 0
        hashes = self.hasher.hash_blocks(list(prompt))
        return self.index.match(hashes).matched_blocks * self.block_size

    def status(self) -> dict[str, Any]:
        return {
            "source": f"md's vLLM KV events at {self.endpoint}",
            "block_size": self.block_size if self.learnt else None,
            "resets": self.resets,
            **self.stats(),
        }
