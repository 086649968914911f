"""vLLM's built-in ``ExampleConnector`` (KV to disk as safetensors), with its hooks timed: the
baseline of ``pddlink bench vllm``. Each request's time in ``save_kv_layer`` (hand KV out) and
``start_load_kv`` (take it in) is appended to ``timing_file`` (JSON lines).

One change of behaviour: vLLM's CPU model runner calls ``start_load_kv`` with a forward context
whose ``attn_metadata`` is still None, and ``ExampleConnector`` then returns without loading
anything ("In connector.start_load_kv, but the attn_metadata is None"): vLLM skips the prefill of
the tokens it was promised and the baseline's load costs nothing (and its KV is left unwritten).
Here the load runs as ExampleConnector's own code does it with metadata present (it needs the
metadata only to tell MLA layers apart: none here), so the baseline's take-in is measured."""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

log = logging.getLogger("pddlink.vllm")


class TimedExampleConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = self._kv_transfer_config.get_from_extra_config("timing_file", None)
        self._timing = Path(path) if path else None
        self._save_s = 0.0

    def _log(self, op: str, seconds: float) -> None:
        if self._timing is not None and seconds > 0:
            with self._timing.open("a") as f:
                f.write(json.dumps({"op": op, "seconds": seconds}) + "\n")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = any(not r.is_store for r in getattr(meta, "requests", []))
        if loads and getattr(forward_context, "attn_metadata", None) is None:
            forward_context = SimpleNamespace(
                no_compile_layers=forward_context.no_compile_layers,
                attn_metadata=defaultdict(lambda: None),  # per layer: not MLA
            )
        t0 = time.perf_counter()
        try:
            super().start_load_kv(forward_context, **kwargs)
        except Exception as exc:  # the stand-in metadata did not fit this vLLM: report, do not crash
            log.warning("ExampleConnector load with stand-in metadata failed: %r", exc)
            self._log("load_error", time.perf_counter() - t0)
            return
        if loads:
            self._log("load", time.perf_counter() - t0)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._save_s += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        super().wait_for_save()  # type: ignore[no-untyped-call]
        self._log("save", self._save_s)
        self._save_s = 0.0
