"""The pipeline policy: which path one request takes, and how RelayDecode hands it over.

Three pipelines exist (DESIGN.md, "Roles and one request's path"):

- ``P_MD``: P prefills and ships the missing suffix over the WAN to MainDecode. Most requests: their
  prefix is already cached on MD, so the delta is small.
- ``P_RLD_MD``: the delta is large, the WAN would take long; RelayDecode (next to P, fast path)
  starts streaming at once and hands over to MD by token ids once MD holds the KV. The suffix still
  crosses the WAN, so MD's cache stays aligned with P's view.
- ``SINGULAR``: P -> RLD and finish there, no WAN transfer. Only when the request's output bound is
  so short that RLD finishes before the WAN transfer would, and (``singular_max_output_tokens``) no
  longer than the policy allows: a request that ends on RLD never feeds MD's prefix cache, so this
  stays the exception; everything else ends on MD.

``choose_pipeline`` is a pure function of ``RoutingInputs`` (what the router knows when a request
arrives: the DRC mirror's match, the link estimate, RLD's load) and a ``RoutingPolicy``. The router
and the simulator call the very same function. ``choose_handoff_mode`` picks one-shot (RLD stops at
once; MD stalls briefly) or catch-up (slices while RLD keeps decoding) by RLD's load at handoff time.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pddlink.errors import ConfigError, require
from pddlink.handoff import HandoffMode
from pddlink.routing.link import LinkEstimate


class Pipeline(StrEnum):
    P_MD = "p_md"
    P_RLD_MD = "p_rld_md"
    SINGULAR = "singular"


class DecisionReason(StrEnum):
    """Why a pipeline was chosen; a label for metrics and traces."""

    RELAY_DISABLED = "relay_disabled"  # deployment without RelayDecode (cross-datacenter PD)
    SMALL_DELTA = "small_delta"  # the WAN delivers the missing suffix quickly enough
    RLD_UNAVAILABLE = "rld_unavailable"  # no RelayDecode reachable
    RLD_BUSY = "rld_busy"  # RelayDecode above its load ceiling
    SHORT_OUTPUT = "short_output"  # singular: RLD finishes before the WAN transfer would
    LARGE_DELTA = "large_delta"  # hide the WAN transfer behind RelayDecode
    FORCED = "forced"  # the client named the pipeline
    RECOMPUTE = "recompute_sooner"  # MD prefills the suffix itself sooner than the WAN ships it
    MD_UNAVAILABLE = "md_unavailable"  # MD stalled or lost recently: RelayDecode runs it alone


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """Knobs of the policy. Defaults are the ones the calibrated simulation uses.

    ``relay_min_wan_s``: relay when the estimated WAN transfer takes at least this long (or longer
    than the request's TTFT target). ``rld_max_load``: RelayDecode's load (active / capacity) above
    which no new relay is started, so RLD stays a small, fast tier. ``catch_up_below_load``: at
    handoff, catch-up while RLD's load is below this, one-shot otherwise (0 forces one-shot, any
    value above 1 forces catch-up). ``singular_max_output_tokens``: only requests whose output bound is
    at most this may end on RLD (None: the "RLD finishes first" test alone decides).
    ``recompute_enabled``: ``choose_option`` may let MD prefill the missing suffix from token ids.
    ``rld_token_budget``: ``choose_option`` opens no relay option while RLD's share of the output
    tokens produced lately is at or above it (1: no budget), so a decode-speed bound that finds MD
    slow cannot move most of the decoding onto RLD.
    """

    relay_enabled: bool = True
    singular_enabled: bool = True
    relay_min_wan_s: float = 1.0
    rld_max_load: float = 0.85
    catch_up_below_load: float = 0.5
    catch_up_slice_tokens: int = 64
    singular_max_output_tokens: int | None = None
    recompute_enabled: bool = False  # MD may prefill the missing suffix itself (``choose_option``)
    rld_token_budget: float = 1.0

    def __post_init__(self) -> None:
        require(self.relay_min_wan_s >= 0, f"relay_min_wan_s must be >= 0, got {self.relay_min_wan_s}")
        require(0 <= self.rld_max_load <= 1, f"rld_max_load must be in [0, 1], got {self.rld_max_load}")
        require(self.catch_up_below_load >= 0, "catch_up_below_load must be >= 0")
        require(self.catch_up_slice_tokens >= 1, "catch_up_slice_tokens must be >= 1")
        require(0 < self.rld_token_budget <= 1, "rld_token_budget must be in (0, 1]")
        require(
            self.singular_max_output_tokens is None or self.singular_max_output_tokens >= 1,
            f"singular_max_output_tokens must be >= 1 or None, got {self.singular_max_output_tokens}",
        )

    def allows_singular(self, max_output_tokens: int) -> bool:
        """Whether a request with this output bound may end on RLD at all (before the timing test)."""
        cap = self.singular_max_output_tokens
        return self.singular_enabled and (cap is None or max_output_tokens <= cap)


@dataclass(frozen=True, slots=True)
class RoutingInputs:
    """What the router knows about one request when it arrives."""

    prompt_tokens: int
    matched_tokens: int  # prefix already cached on MD, per the DRC mirror
    kv_bytes_per_token: int
    max_output_tokens: int
    link: LinkEstimate
    rld_available: bool = True
    rld_active: int = 0
    rld_capacity: int = 1
    rld_tpot_s: float = 0.03  # RelayDecode's current time per output token
    ttft_target_s: float | None = None

    def __post_init__(self) -> None:
        require(self.prompt_tokens >= 1, f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        require(
            0 <= self.matched_tokens <= self.prompt_tokens,
            f"matched_tokens must be in [0, prompt_tokens={self.prompt_tokens}], got {self.matched_tokens}",
        )
        require(self.kv_bytes_per_token >= 1, "kv_bytes_per_token must be >= 1")
        require(self.max_output_tokens >= 1, "max_output_tokens must be >= 1")
        require(self.rld_active >= 0, "rld_active must be >= 0")
        require(self.rld_capacity >= 1, "rld_capacity must be >= 1")
        require(self.rld_tpot_s > 0, "rld_tpot_s must be > 0")
        require(self.ttft_target_s is None or self.ttft_target_s > 0, "ttft_target_s must be > 0")

    @property
    def missing_tokens(self) -> int:
        return self.prompt_tokens - self.matched_tokens

    @property
    def wan_bytes(self) -> int:
        return self.missing_tokens * self.kv_bytes_per_token

    @property
    def rld_load(self) -> float:
        return self.rld_active / self.rld_capacity


@dataclass(frozen=True, slots=True)
class PipelineDecision:
    pipeline: Pipeline
    reason: DecisionReason
    wan_bytes: int  # bytes the WAN must carry (0 for singular)
    wan_estimate_s: float  # the link model's estimate for the missing suffix


@dataclass(frozen=True, slots=True)
class HandoffDecision:
    mode: HandoffMode
    slice_tokens: int  # catch-up slice; 0 for one-shot


def rld_finishes_first(max_output_tokens: int, rld_tpot_s: float, wan_s: float) -> bool:
    """True when RLD can emit the whole output bound before the WAN transfer would complete."""
    return max_output_tokens * rld_tpot_s <= wan_s


def choose_pipeline(inputs: RoutingInputs, policy: RoutingPolicy) -> PipelineDecision:
    """Pick the pipeline for one request. Pure and cheap (a few comparisons)."""
    wan_bytes = inputs.wan_bytes
    wan_s = inputs.link.transfer_s(wan_bytes)

    def decide(pipeline: Pipeline, reason: DecisionReason) -> PipelineDecision:
        shipped = 0 if pipeline is Pipeline.SINGULAR else wan_bytes
        return PipelineDecision(pipeline, reason, shipped, wan_s)

    if not policy.relay_enabled:
        return decide(Pipeline.P_MD, DecisionReason.RELAY_DISABLED)
    threshold = policy.relay_min_wan_s
    if inputs.ttft_target_s is not None:
        threshold = min(threshold, inputs.ttft_target_s)
    if wan_s < threshold:
        return decide(Pipeline.P_MD, DecisionReason.SMALL_DELTA)
    if not inputs.rld_available:
        return decide(Pipeline.P_MD, DecisionReason.RLD_UNAVAILABLE)
    load = inputs.rld_load
    if (
        policy.allows_singular(inputs.max_output_tokens)
        and load < 1.0
        and rld_finishes_first(inputs.max_output_tokens, inputs.rld_tpot_s, wan_s)
    ):
        return decide(Pipeline.SINGULAR, DecisionReason.SHORT_OUTPUT)
    if load >= policy.rld_max_load:
        return decide(Pipeline.P_MD, DecisionReason.RLD_BUSY)
    return decide(Pipeline.P_RLD_MD, DecisionReason.LARGE_DELTA)


def choose_handoff_mode(rld_load: float, policy: RoutingPolicy) -> HandoffDecision:
    """One-shot frees a loaded RLD at once; catch-up keeps a lightly loaded one streaming."""
    if rld_load < 0:
        raise ConfigError(f"rld_load must be >= 0, got {rld_load}")
    if rld_load < policy.catch_up_below_load:
        return HandoffDecision(HandoffMode.CATCH_UP, policy.catch_up_slice_tokens)
    return HandoffDecision(HandoffMode.ONE_SHOT, 0)
