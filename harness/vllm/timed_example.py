"""vLLM's built-in ``ExampleConnector`` (KV to disk as safetensors), with its hooks timed: the
baseline of ``pddlink bench vllm``. Its hooks are timed by the same clock, at the same boundaries,
as ``PddlinkConnector``'s (``engines_adapter.vllm.hook_timing``): every worker hook of the step that
stores a request's KV ("save") or loads it ("load"), and the scheduler hooks per request ("sched"),
appended to ``timing_file`` (JSON lines).

ExampleConnector's own convention: a request whose prompt equals a stored one (prefix caching off)
loads the stored KV of its whole blocks below the last prompt token, synchronously in
``start_load_kv`` before the forward. (A prompt one token longer is "found" by its scheduler side
but looked up under a different name by its worker side: FileNotFoundError, nothing loaded.)

One change of behaviour: vLLM's CPU model runner calls ``start_load_kv`` with a forward context
whose ``attn_metadata`` is still None, and ``ExampleConnector`` then returns without loading
anything ("In connector.start_load_kv, but the attn_metadata is None"): vLLM skips the prefill of
the tokens it was promised and the baseline's load costs nothing (and its KV is left unwritten).
Here the load runs as ExampleConnector's own code does it with metadata present (it needs the
metadata only to tell MLA layers apart: none here), so the baseline's take-in is measured."""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from engines_adapter.vllm.hook_timing import HookClock

log = logging.getLogger("pddlink.vllm")


class TimedExampleConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = self._kv_transfer_config.get_from_extra_config("timing_file", None)
        self._clock = HookClock.install(
            self, Path(path) if path else None, worker=self.role == KVConnectorRole.WORKER
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = any(not r.is_store for r in getattr(meta, "requests", []))
        if not loads:
            return
        if self._clock is not None:
            self._clock.mark("load")
        if getattr(forward_context, "attn_metadata", None) is None:
            forward_context = SimpleNamespace(
                no_compile_layers=forward_context.no_compile_layers,
                attn_metadata=defaultdict(lambda: None),  # per layer: not MLA
            )
        try:
            super().start_load_kv(forward_context, **kwargs)
        except Exception as exc:  # the stand-in metadata did not fit this vLLM: report, do not crash
            log.warning("ExampleConnector load with stand-in metadata failed: %r", exc)
            if self._clock is not None:
                self._clock.note("load_error", repr(exc))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self._clock is not None and any(r.is_store for r in self._get_connector_metadata().requests):  # type: ignore[attr-defined]
            self._clock.mark("save")
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
