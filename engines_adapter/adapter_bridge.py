"""The bridge to an engine the sidecar drives (``EngineKind.REFERENCE``; see ``engines_adapter.bridge``).

``AdapterBridge(engine, max_batch, drc_blocks)`` holds an ``EngineAdapter`` (in this process, or a
``RemoteEngine`` whose process the daemon started) and the ``EngineLoop`` every call goes through;
with ``drc_blocks`` (MD, P) the engine's prefix cache as a DRC (``DrcHost``) of that many blocks.
Lifecycle: ``start()`` inside the event loop (the worker thread, the batched decode), the role
logic calls ``loop.call(...)`` and ``loop.decode_in_batch(...)``, ``close()`` last. ``health()``:
an engine in another process that is gone says so; one in this process serves while the sidecar
does.
"""

from __future__ import annotations

from typing import Any

from engines_adapter.base import EngineAdapter
from engines_adapter.bridge import EngineKind
from engines_adapter.drc_host import DrcHost
from engines_adapter.engine_loop import EngineLoop
from pddlink.drc import PrefixIndex


class AdapterBridge:
    kind = EngineKind.REFERENCE

    def __init__(self, engine: EngineAdapter, max_batch: int, drc_blocks: int | None = None) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine, max_batch)
        self.drc = DrcHost(engine, capacity_blocks=max(1, drc_blocks)) if drc_blocks is not None else None
        self.model_id = engine.layout.model_id
        self.block_size = engine.layout.block_size

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self.drc.index if self.drc is not None else None

    def start(self) -> None:
        self.loop.start()

    def health(self) -> str:
        return "" if bool(getattr(self.engine, "alive", True)) else "the engine process is gone"

    def status(self) -> dict[str, Any]:
        return {
            "engine_active": self.loop.active,
            "kv_bytes_per_token": self.engine.layout.bytes_per_token,
        }

    async def close(self) -> None:
        await self.loop.close()
