"""The engine beside a sidecar: one worker thread runs every engine call; one task batches decode.

Lifecycle: ``EngineLoop(engine, max_batch)``; ``start()`` inside the event loop; ``await call(fn,
...)`` for prefill/import/extend/export/release (serialised with decode steps, since an engine is
not thread-safe); ``decode_in_batch(rid, sink)`` adds a request to the batched decode loop, whose
``sink(StepOutput)`` gets each token (``None`` if the engine failed it); ``await
stop_decoding(rid)`` takes it out after the step in flight (so every token it produced has reached
the sink); ``close()``.

The engine runs in a worker thread of the sidecar process: the event loop keeps serving gRPC and
the data plane while a forward pass runs. An engine in another process (``RemoteEngine``,
``engine.mode = "process"``) offers ``call_async``: its own methods are then awaited on the event
loop directly (no thread hand-off per call; the engine process runs commands in arrival order).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engines_adapter import EngineAdapter, StepOutput
from pddlink import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
Sink = Callable[[StepOutput | None], None]  # None: the engine failed this request


class EngineLoop:
    def __init__(self, engine: EngineAdapter, max_batch: int = 32) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._sinks: dict[str, Sink] = {}
        self._in_step: set[str] = set()
        self._stopped: dict[str, asyncio.Future[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rotate = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._decode_forever(), name="decode-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def active(self) -> int:
        return len(self._sinks)

    async def call(self, op: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        native = getattr(self.engine, "call_async", None)
        try:
            if native is not None and getattr(fn, "__self__", None) is self.engine:
                result: T = await native(getattr(fn, "__name__", ""), *args, **kwargs)
                return result
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        finally:
            metrics.ENGINE_STEP_SECONDS.labels(op=op).observe(time.perf_counter() - t0)

    def decode_in_batch(self, request_id: str, sink: Sink) -> None:
        self._sinks[request_id] = sink
        metrics.ENGINE_ACTIVE.set(len(self._sinks))
        self._wake.set()

    def is_decoding(self, request_id: str) -> bool:
        return request_id in self._sinks

    async def stop_decoding(self, request_id: str) -> None:
        """Out of the batch; returns once no step that includes it is running."""
        if request_id not in self._sinks:
            return
        if request_id not in self._in_step:
            self._remove(request_id)
            return
        fut = self._stopped.setdefault(request_id, asyncio.get_running_loop().create_future())
        await fut

    def _remove(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        metrics.ENGINE_ACTIVE.set(len(self._sinks))
        fut = self._stopped.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _next_batch(self) -> list[str]:
        ids = [r for r in self._sinks if r not in self._stopped]
        if len(ids) <= self.max_batch:
            return ids
        self._rotate = (self._rotate + self.max_batch) % len(ids)
        return (ids[self._rotate :] + ids[: self._rotate])[: self.max_batch]

    async def _decode_forever(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                for rid in list(self._stopped):
                    self._remove(rid)
                self._wake.clear()
                await self._wake.wait()
                continue
            self._in_step = set(batch)
            try:
                outs = await self.call("decode", self.engine.decode, batch)
            except Exception:  # the fault boundary around engine code (EngineError, torch's
                # RuntimeError, a remote engine's transport errors): it fails the batch's requests,
                # never the decode loop, and says why in the log
                log.exception("decode step failed; failing %d request(s): %s", len(batch), ", ".join(batch))
                outs = []
                for rid in batch:
                    failed = self._sinks.get(rid)
                    self._remove(rid)
                    if failed is not None:
                        failed(None)
            finally:
                self._in_step = set()
            for out in outs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
                if out.finished:
                    self._remove(out.request_id)
            for rid in list(self._stopped):
                self._remove(rid)
            await asyncio.sleep(0)  # let gRPC and the data plane run between steps
