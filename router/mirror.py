"""The router's DRC mirror: follows MD's DRC event stream so that per-request choices read a local
copy (``Mirror``) and never wait on MD.

The first message of each stream is a snapshot (it also gives the block size and the hash root);
events follow. A gap the mirror cannot bridge, or MD going away, ends the stream; the follower
reconnects shortly and starts again from a snapshot.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from pddlink.drc import Mirror, decode_event, decode_snapshot
from pddlink.kv.hashing import BlockHasher
from sidecar.pb import pb2

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
