"""The engine bridge: what a sidecar needs from the engine beside it, whichever engine that is.

``pddlink sidecar`` (``sidecar.daemon``) is one program beside one engine. The engine is of one of
two kinds (``EngineKind``), which differ in who schedules:

- ``reference``: the sidecar drives the engine. ``AdapterBridge`` (``engines_adapter.adapter_bridge``)
  holds an ``EngineAdapter`` (the reference torch engine or HF in this process, or either in a
  child process through ``RemoteEngine``) and the ``EngineLoop`` that serialises its calls; the
  sidecar's prefiller and decoder call prefill, export_kv, import_kv, extend, decode and release
  (``engines_adapter.base``), and on MD the engine's prefix cache is kept as a DRC beside its pool
  (``engines_adapter.drc_host``).
- ``vllm``: vLLM schedules itself and calls the sidecar. ``VllmBridge``
  (``engines_adapter.vllm.bridge``) holds the shared-memory region KV moves through, the control
  socket vLLM's ``PddlinkConnector`` dials (PREPARE/ALLOC/COMMIT on P: export; POLL/RELEASE on RLD
  and MD: import), the watch on the vLLM process behind it, and the DRC that vLLM's KV-cache events
  feed (RLD, MD).

What every sidecar reads from either, through ``EngineBridge``:

    kind, model_id, block_size   the READY line, /status, the block hashes placement uses
    health()                     "" while the engine serves this sidecar, else why not
                                 (/healthz and /readyz say 503 with it)
    status()                     the engine side's own figures (/status "engine_side")
    prefix_index                 the engine's prefix cache as the DRC holds it; None on roles
                                 that keep none (P)
    close()                      after the sidecar's listeners and peers: what the engine side
                                 holds (the worker thread or child process; the region and socket)

Starting differs by kind (the reference engine is loaded before anything listens; vLLM's region
and socket are made before its connector dials), so each bridge has its own ``start``. Sans the
daemon: both are built and closed by ``sidecar.daemon``, and the role logic (``sidecar.reference``,
``sidecar.vllm_kv``) uses the concrete bridge.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

from pddlink.drc import PrefixIndex


class EngineKind(StrEnum):
    REFERENCE = "reference"
    VLLM = "vllm"


class EngineBridge(Protocol):
    kind: EngineKind
    model_id: str
    block_size: int

    @property
    def prefix_index(self) -> PrefixIndex | None: ...

    def health(self) -> str: ...

    def status(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
