"""vLLM's CPU attention kept off its AMX kernel where ``PddlinkConnector`` runs (the connector
calls ``attention_without_amx`` when it is imported, in every vLLM process that loads it)."""

from __future__ import annotations

import os
from typing import Any


def attention_without_amx() -> None:
    """Keep vLLM's CPU attention off its AMX kernel in the processes that load this connector.

    On a CPU with AMX, vLLM picks the "amx" attention ISA for bfloat16 with 32-token blocks; with
    KV loaded through this connector MD's engine then died at its first decode step with SIGILL
    inside ``cpu_attention_with_kv_cache`` (measured 2026-12-02: every bf16 request of the demo's
    bf16 phase failed; bare vLLM with its own prefix cache ran, and with the ISA forced to "vec"
    the same P->MD requests finished). Until the connector's block copy is checked against that
    kernel's cache, the "vec" kernel is used instead (``PDDLINK_VLLM_AMX=1`` keeps AMX).
    """
    if os.environ.get("PDDLINK_VLLM_AMX") == "1":
        return
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:  # not a CPU build of vLLM
        return
    pick = cpu_attn._get_attn_isa
    if getattr(pick, "_pddlink", False):
        return

    def without_amx(*args: Any, **kwargs: Any) -> str:
        isa = pick(*args, **kwargs)
        return "vec" if isa == "amx" else isa

    without_amx._pddlink = True  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = without_amx
