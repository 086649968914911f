"""One request's trace at the router: what was decided, what the legs reported, how it ended.

``TraceBuilder`` is the run machine's mutable notebook; ``RunTrace`` is the frozen result handed to
the client (``to_dict``: the JSON object of the ``pddlink`` field and of ``trace_json``, with the
keys it has always had; fields never reported are left out, as before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pddlink.handoff import HandoffMode
from pddlink.lifecycle.events import PrefillReport
from pddlink.lifecycle.outcomes import FailReason, Fallback, HandoffResult, RunOutcome
from pddlink.lifecycle.stall import MD_STALL_MIN_S
from pddlink.routing import Option, Pipeline
from pddlink.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What the router decided for the request before its run starts."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    deadline_s: float
    pipeline: Pipeline
    decision_reason: str
    wan_estimate_s: float
    mirror_matched_tokens: int = 0
    option: Option = Option.SHIP  # ship or recompute (``pddlink.routing.choose_option``)
    md_stall_s: float = MD_STALL_MIN_S  # no progress from MD this long is a stall (``lifecycle.stall``)


@dataclass(frozen=True, slots=True)
class RunTrace:
    request_id: str
    pipeline: Pipeline
    decision_reason: str
    wan_estimate_s: float
    prompt_tokens: int
    mirror_matched_tokens: int
    outcome: RunOutcome
    reason: FailReason | None
    reason_detail: str
    fallbacks: tuple[Fallback, ...]
    wan_bytes: int
    fast_bytes: int
    handoff_mode: HandoffMode | None
    handoff: HandoffResult | None
    prefill: PrefillReport | None  # P's latest reply
    md_error: str
    rld_error: str
    ttft_s: float | None
    e2e_s: float
    md_recompute_s: float | None  # MD's own prefill (recompute), from its ready event
    md_cached_tokens: int | None  # of the prompt MD's cache held (P's report, or MD's ready event)
    tokens: tuple[tuple[str, int], ...]  # (source, count) in order of first appearance
    output_tokens: int
    divergences: int

    @property
    def reason_text(self) -> str:
        if self.reason is None:
            return ""
        return f"{self.reason.value}: {self.reason_detail}" if self.reason_detail else self.reason.value

    @property
    def rld_suspect(self) -> bool:
        """RLD failed this request: the router keeps new requests off it for a while."""
        return bool(self.rld_error) or Fallback.RLD_LOST_MD_TAKES_OVER in self.fallbacks

    @property
    def md_streamed(self) -> bool:
        """MD streamed tokens for this request and never stalled: it is healthy."""
        stalls = (Fallback.MD_STALLED_P_RLD, Fallback.MD_STALLED_RLD_FINISHES)
        return dict(self.tokens).get("md", 0) > 0 and not any(f in stalls for f in self.fallbacks)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "pipeline": self.pipeline.value,
            "decision_reason": self.decision_reason,
            "wan_estimate_s": self.wan_estimate_s,
            "wan_bytes": self.wan_bytes,
            "fast_bytes": self.fast_bytes,
            "handoff_mode": self.handoff_mode.value if self.handoff_mode is not None else "",
            "fallbacks": [f.value for f in self.fallbacks],
            "prompt_tokens": self.prompt_tokens,
            "mirror_matched_tokens": self.mirror_matched_tokens,
        }
        if (r := self.prefill) is not None:
            d.update(
                wan_seconds=r.wan_seconds,
                fast_seconds=r.fast_seconds,
                wan_rtt_s=r.wan_rtt_s,
                wan_retransmits=r.wan_retransmits,
                compression_ratio=r.compression_ratio or 1.0,
                p_cached_tokens=r.p_cached_tokens,
                fast_path=r.fast_path,
                prefill_seconds=r.prefill_seconds,
            )
        if self.md_cached_tokens is not None:
            d["md_cached_tokens"] = self.md_cached_tokens
        if self.md_recompute_s is not None:
            d["md_recompute_s"] = self.md_recompute_s
        if self.md_error:
            d["md_error"] = self.md_error
        if self.rld_error:
            d["rld_error"] = self.rld_error
        if self.handoff is not None:
            d["handoff_outcome"] = self.handoff.render()
        d.update(
            outcome=self.outcome.value,
            reason=self.reason_text,
            ttft_s=self.ttft_s,
            e2e_s=self.e2e_s,
            tokens=dict(self.tokens),
            output_tokens=self.output_tokens,
            divergences=self.divergences,
        )
        return d


@dataclass(slots=True)
class TraceBuilder:
    """The run machine's notebook (mutable; ``freeze`` gives the ``RunTrace``)."""

    spec: RunSpec
    fallbacks: list[Fallback] = field(default_factory=list)
    wan_bytes: int = 0
    fast_bytes: int = 0
    handoff_mode: HandoffMode | None = None
    handoff: HandoffResult | None = None
    prefill: PrefillReport | None = None
    md_error: str = ""
    rld_error: str = ""
    ttft_s: float | None = None
    md_recompute_s: float | None = None
    md_cached_tokens: int | None = None

    def on_prefill(self, r: PrefillReport, *, recompute: bool = False) -> None:
        """P's reply; on a recomputing leg MD's cache figure comes from MD's ready event instead."""
        if not recompute:
            self.md_cached_tokens = r.md_cached_tokens
        self.wan_bytes += r.wan_bytes
        self.fast_bytes += r.fast_bytes
        self.prefill = r
        self.md_error = r.md_error or self.md_error
        self.rld_error = r.rld_error or self.rld_error

    def freeze(
        self,
        *,
        outcome: RunOutcome,
        reason: FailReason | None,
        detail: str,
        e2e_s: float,
        tokens: dict[str, int],
        output_tokens: int,
        divergences: int,
    ) -> RunTrace:
        s = self.spec
        return RunTrace(
            request_id=s.request_id,
            pipeline=s.pipeline,
            decision_reason=s.decision_reason,
            wan_estimate_s=s.wan_estimate_s,
            prompt_tokens=len(s.prompt),
            mirror_matched_tokens=s.mirror_matched_tokens,
            outcome=outcome,
            reason=reason,
            reason_detail=detail,
            fallbacks=tuple(self.fallbacks),
            wan_bytes=self.wan_bytes,
            fast_bytes=self.fast_bytes,
            handoff_mode=self.handoff_mode,
            handoff=self.handoff,
            prefill=self.prefill,
            md_error=self.md_error,
            rld_error=self.rld_error,
            ttft_s=self.ttft_s,
            e2e_s=e2e_s,
            md_recompute_s=self.md_recompute_s,
            md_cached_tokens=self.md_cached_tokens,
            tokens=tuple(tokens.items()),
            output_tokens=output_tokens,
            divergences=divergences,
        )
