"""The bridge to a vLLM server (``EngineKind.VLLM``; see ``engines_adapter.bridge``): vLLM schedules
itself, and its ``PddlinkConnector`` calls the sidecar.

What it holds, one sidecar's worth:

- the shared-memory region KV moves through (``pddlink.connector.shm``; by default in /dev/shm where
  it has room, so copies touch RAM only);
- the control socket ``<workdir>/<name>.sock`` the connector dials (``pddlink.connector.control``),
  answered by the handler the role logic gives (P: ``ProducerBridge``; RLD, MD: ``ConsumerBridge``);
- the watch on the vLLM process behind the socket (``engine_link``): when it dies, the feed's DRC
  is cleared and the role logic's ``on_lost(reason)`` resets what it held for that engine;
- on RLD and MD, the engine's prefix cache as a DRC (``prefix_index``), fed by vLLM's KV-cache
  events when ``kv_events_endpoint`` is set (without it the index stays empty and P is answered 0).

Lifecycle: ``open()`` makes the region (and the index); ``await serve(handler, on_lost)`` starts the
socket and the feed; ``await stop_serving()`` closes the socket and the feed (no new calls from
vLLM); ``await close()`` after the role logic let go of its slots: the region is unlinked and the
socket file removed. ``health()`` is "" throughout: the sidecar outlives its vLLM (a killed engine
is reset and the next one served).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines_adapter.bridge import EngineKind
from engines_adapter.vllm.engine_link import EngineMonitor
from pddlink.connector.control import Handler, serve_control
from pddlink.connector.kv_events import KvEventFeed
from pddlink.connector.shm import ShmRegion, region_path
from pddlink.drc import PrefixIndex


@dataclass(frozen=True, slots=True)
class VllmEngineSide:
    """Where the engine side of one sidecar lives (from the sidecar's ``[vllm]`` table)."""

    name: str  # the sidecar's identity: the socket's and the region's name
    workdir: Path
    model_id: str
    block_size: int
    region_bytes: int = 256 << 20
    region_dir: Path | None = None  # None: /dev/shm where it has room, else workdir
    keeps_prefix_cache: bool = False  # RLD, MD: a DRC of vLLM's prefix cache
    kv_events_endpoint: str = ""  # vLLM's ZMQ publisher (tcp://127.0.0.1:PORT); "" = no feed


class VllmBridge:
    kind = EngineKind.VLLM

    def __init__(self, side: VllmEngineSide) -> None:
        self.side = side
        self.model_id, self.block_size = side.model_id, side.block_size
        self.region: ShmRegion | None = None
        self._index = PrefixIndex(None) if side.keeps_prefix_cache else None
        self.feed: KvEventFeed | None = None
        self._control: asyncio.AbstractServer | None = None
        self._on_lost: Callable[[str], None] = lambda reason: None
        self.monitor = EngineMonitor(self._lost)

    @property
    def control_path(self) -> Path:
        return self.side.workdir / f"{self.side.name}.sock"

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self._index

    def open(self) -> ShmRegion:
        s = self.side
        s.workdir.mkdir(parents=True, exist_ok=True)
        self.region = ShmRegion(region_path(s.workdir, s.name, s.region_bytes, s.region_dir), s.region_bytes)
        return self.region

    async def serve(self, handler: Handler, on_lost: Callable[[str], None]) -> None:
        """vLLM's connector may call from now on; ``on_lost``: its engine died (reset what it held)."""
        self._on_lost = on_lost
        if self._index is not None and self.side.kv_events_endpoint:
            self.feed = KvEventFeed(self._index, model_id=self.model_id, block_size=self.block_size)
            self.feed.start(self.side.kv_events_endpoint)
        self._control = await serve_control(self.control_path, handler, watch=self.monitor)

    def _lost(self, reason: str) -> None:
        if self.feed is not None:
            self.feed.engine_lost(time.monotonic())
        self._on_lost(reason)

    def health(self) -> str:
        return ""

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.monitor.watch.status()}
        if self.feed is not None:
            out["kv_events"] = self.feed.stats()
        return out

    async def stop_serving(self) -> None:
        self.monitor.close()
        if self._control is not None:
            self._control.close()
            with contextlib.suppress(Exception):
                await self._control.wait_closed()
            self._control = None
        if self.feed is not None:
            await self.feed.close()
            self.feed = None

    async def close(self) -> None:
        await self.stop_serving()
        if self.region is not None:
            self.region.close()
            self.region = None
        self.control_path.unlink(missing_ok=True)
