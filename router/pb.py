"""The sidecar protocol's replies as lifecycle values: P's ``PrefillReply`` as a ``PrefillReport``,
a handoff mode's text as a ``HandoffMode`` (the router's one converter for each)."""

from __future__ import annotations

from typing import Any

from pddlink.lifecycle import PrefillReport
from pddlink.serving.stream_pb import mode_from_text

__all__ = ["mode_from_text", "report_from_pb"]


def report_from_pb(r: Any) -> PrefillReport:
    return PrefillReport(
        first_token=int(r.first_token),
        md_ok=bool(r.md_ok),
        rld_ok=bool(r.rld_ok),
        wan_bytes=int(r.wan_bytes),
        fast_bytes=int(r.fast_bytes),
        wan_seconds=r.wan_seconds,
        fast_seconds=r.fast_seconds,
        wan_rtt_s=r.wan_rtt_s,
        wan_retransmits=int(r.wan_retransmits),
        compression_ratio=r.compression_ratio,
        md_cached_tokens=int(r.md_cached_tokens),
        p_cached_tokens=int(r.p_cached_tokens),
        fast_path=r.fast_path,
        prefill_seconds=r.prefill_seconds,
        md_error=r.md_error,
        rld_error=r.rld_error,
    )
