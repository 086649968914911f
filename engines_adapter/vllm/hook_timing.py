"""The bench's clock on a KV connector's hooks: the same boundaries for every connector timed.

``HookClock.install(connector, timing_file)`` wraps, on that one instance, every hook vLLM calls
on its side (worker: ``bind_connector_metadata`` .. ``clear_connector_metadata``, the whole
lifecycle vLLM's ``KVConnectorModelRunnerMixin`` runs around a step's forward; scheduler:
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished``). A hook called from another timed hook (a
connector's ``get_finished`` calling ``get_transfer_results``, or the other way round) counts once.
The time is what vLLM waits on: the forward itself and the clock's own file writes are outside.

Records (JSON lines appended to ``timing_file``):
  worker, at the end of each step the connector marked (``clock.mark("save" | "load")``): one
    record, ``{"op": kind (both joined by "+" in a step that did both), "seconds": the step's
    hook time, "hooks": {name: s}, "cpu_s": the thread's CPU time in them (wall minus CPU:
    the time the thread was off the CPU, preempted or blocked), "idle_s": .., "idle_steps": ..}``
    (idle: the unmarked steps since the last record, e.g. MD polling while the KV is still on
    the wire; not part of ``seconds``), plus any phases the connector noted (``clock.note(name, seconds)``);
  scheduler, after each ``request_finished``: ``{"op": "sched", "seconds": .., "hooks": {...}}``,
    the scheduler hooks' time since the previous ``request_finished`` (the bench sends one request
    at a time, so that is the request's).
Without a timing file nothing is wrapped and the hooks run as they are.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
)
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)


class HookClock:
    def __init__(self, path: Path, role: str) -> None:
        self.path, self.role = path, role
        self._depth = 0
        self._hooks: dict[str, float] = {}
        self._marks: list[str] = []
        self._notes: dict[str, float | str] = {}
        self._idle_s = 0.0
        self._idle_steps = 0
        self._cpu_s = 0.0  # the calling thread's CPU time inside the hooks (wall - cpu: off CPU)

    @classmethod
    def install(cls, connector: Any, path: Path | None, *, worker: bool) -> HookClock | None:
        if path is None:
            return None
        clock = cls(path, "worker" if worker else "scheduler")
        for name in WORKER_HOOKS if worker else SCHEDULER_HOOKS:
            if hasattr(connector, name):
                setattr(connector, name, clock._wrap(name, getattr(connector, name)))
        clear = connector.clear_connector_metadata
        if worker:

            def clear_and_flush() -> None:
                t0 = time.perf_counter()
                clear()
                clock._add("clear_connector_metadata", time.perf_counter() - t0)
                clock.end_step()

            connector.clear_connector_metadata = clear_and_flush
        return clock

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(name, time.perf_counter() - t0)
                self._cpu_s += time.thread_time() - c0
                self._depth -= 1
                if name == "request_finished" and self.role == "scheduler":
                    self._flush("sched")

        return timed

    def _add(self, name: str, seconds: float) -> None:
        self._hooks[name] = self._hooks.get(name, 0.0) + seconds

    def mark(self, kind: str) -> None:
        """This step carried a request's KV out ("save") or in ("load")."""
        if kind not in self._marks:
            self._marks.append(kind)

    def note(self, name: str, value: float | str) -> None:
        """A phase inside a hook (e.g. the copy), reported with the step's record."""
        self._notes[name] = value

    def end_step(self) -> None:
        if not self._marks:
            self._idle_s += sum(self._hooks.values())
            self._idle_steps += 1
            self._cpu_s = 0.0
            self._hooks.clear()
            self._notes.clear()
            return
        self._flush("+".join(self._marks))  # one step carrying both: one record, both named
        self._marks.clear()

    def _flush(self, op: str) -> None:
        rec: dict[str, Any] = {
            "op": op,
            "seconds": sum(self._hooks.values()),
            "hooks": dict(self._hooks),
            "cpu_s": self._cpu_s,
            **self._notes,
        }
        self._cpu_s = 0.0
        if self.role == "worker":
            rec.update(idle_s=self._idle_s, idle_steps=self._idle_steps)
            self._idle_s, self._idle_steps = 0.0, 0
        self._hooks.clear()
        self._notes.clear()
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
