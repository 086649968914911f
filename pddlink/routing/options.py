"""Ship or recompute, relay or not, admit or reject: the per-request option policy.

When the WAN is the bottleneck, shipping KV is not the only way to get a prompt's KV onto
MainDecode: MD can prefill the missing suffix itself from the token ids (a few bytes on the WAN
instead of megabytes), paying MD's own prefill time. Each way combines with RelayDecode or not:

=================  =======================================  =========================================
option             who produces the first tokens            how MD gets the prompt's KV
=================  =======================================  =========================================
``SHIP``           MD, once the suffix has crossed the WAN  P ships the missing suffix (P->MD)
``RELAY``          RLD at once, handoff by token ids        P ships the missing suffix (P->RLD->MD)
``RECOMPUTE``      MD, once it has prefilled the suffix     MD prefills it from token ids
``RELAY_RECOMPUTE`` RLD at once, handoff by token ids       MD prefills it while RLD streams
``SINGULAR``       RLD, which finishes the request          never (a short output only)
=================  =======================================  =========================================

``choose_option(OptionInputs, RoutingPolicy)`` estimates, for every option the deployment allows,
the time to the first token, the time until MD holds the prompt's KV and the time the request
ends, all from what the caller observed (the link estimate with its backlog, P's and MD's prefill
queues, RLD's load). It then picks:

1. only options that end before the request's deadline, and relay options only while RelayDecode
   is below its load ceiling (``rld_max_load``); singular only as ``RoutingPolicy`` allows it;
2. an MD-only option when MD is ready soon enough (``relay_min_wan_s``, or the TTFT target when
   shorter), shipping first, recomputing second (it spends MD's decode-leaning chips on prefill):
   RLD stays a small tier and every such request ends on MD, so MD's cache stays aligned with P's;
3. otherwise singular for a short output RLD finishes first, else the relay option whose MD side
   is ready first (fewest tokens on RLD);
4. otherwise the MD-only option with the earlier first token;
5. and when nothing meets the deadline: a rejection with a typed reason and a retry hint.

A decode-speed bound (``OptionInputs.tpot_bound_s``, the SLO's time per output token) adds a second
half to "meets": this request's own expected TPOT, and the TPOT of the requests MD decodes while it
recomputes, stay within it (``pddlink.routing.decode_bound``: what a recompute's stall costs them,
and how many it may push over, ``PUSHED_OVER_LIMIT`` while a relay option keeps every bound, else
``PUSHED_OVER_LIMIT_WITHOUT_RELAY``).
Under a TTFT bound (``ttft_deadline_s``), an option that ships KV meets it only if that KV holds
the line no longer than the bound (``OptionEstimate.line_s``: its bytes over the line's rate): a
relay's first token comes from RLD at once, but on a line too thin for its suffix its shipment
outlives the request and every request that ships behind it misses its own first token (wan-overload:
9-15 of 200 shipped requests at 3-7 s behind one or two relayed low-hit prompts of 1.5 MB on a 3.3
Mbit/s line, none in the run without relays). An option that breaks the bound is not chosen while
another meets every bound; a request whose
every option meets the deadlines only by breaking it is rejected as ``TPOT_UNREACHABLE``. What the
bound moves off MD lands on RelayDecode, so relay options are open only while RLD's share of the
tokens lately produced (``rld_token_share``) is under ``RoutingPolicy.rld_token_budget``: RLD
stays a small tier however slow MD looks. Shipping and a handoff's extend step are not charged to MD's
batch (importing KV and extending a few hundred token ids fit in a step).

Without recompute and without a deadline this is exactly ``choose_pipeline``; without a TPOT bound it
is what it was before the bound existed. Pure: the router and the simulator call the same function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from pddlink.errors import require
from pddlink.routing.decode_bound import (
    PUSHED_OVER_LIMIT,
    PUSHED_OVER_LIMIT_WITHOUT_RELAY,
    MdPrefill,
    MdRun,
    expected_pushed_over,
    hold_for_short_runs,
    tpot_headroom_s,
)
from pddlink.routing.outputs import OutputLengths
from pddlink.routing.policy import (
    DecisionReason,
    Pipeline,
    RoutingInputs,
    RoutingPolicy,
    rld_finishes_first,
)


class Option(StrEnum):
    SHIP = "ship"
    RELAY = "relay"
    RECOMPUTE = "recompute"
    RELAY_RECOMPUTE = "relay_recompute"
    SINGULAR = "singular"

    @property
    def pipeline(self) -> Pipeline:
        """The legs it runs: MD alone, RLD then MD, or RLD alone."""
        return _PIPELINE[self]

    @property
    def relays(self) -> bool:
        return self in (Option.RELAY, Option.RELAY_RECOMPUTE, Option.SINGULAR)

    @property
    def recomputes(self) -> bool:
        return self in (Option.RECOMPUTE, Option.RELAY_RECOMPUTE)

    @property
    def ships_kv(self) -> bool:
        return self in (Option.SHIP, Option.RELAY)


class RecomputeMode(IntEnum):
    """How MD gets a request's KV (the Attach request's ``recompute`` field, values fixed by the
    proto): NONE (shipped by P), AND_DECODE (``Option.RECOMPUTE``: MD prefills, streams the first
    token and decodes), FOR_HANDOFF (``Option.RELAY_RECOMPUTE``: MD prefills while RLD streams)."""

    NONE = 0
    AND_DECODE = 1
    FOR_HANDOFF = 2

    @classmethod
    def of(cls, option: Option) -> RecomputeMode:
        if option is Option.RECOMPUTE:
            return cls.AND_DECODE
        if option is Option.RELAY_RECOMPUTE:
            return cls.FOR_HANDOFF
        return cls.NONE


def md_miss_label(md_error: str) -> str:
    """``wan_congested`` when the transfer lost to its deadline (the line was full), else
    ``md_unreachable``: the prefix of the fallback kinds the router records."""
    return "wan_congested" if md_error.startswith("deadline_exceeded") else "md_unreachable"


_PIPELINE = {
    Option.SHIP: Pipeline.P_MD,
    Option.RELAY: Pipeline.P_RLD_MD,
    Option.RECOMPUTE: Pipeline.P_MD,
    Option.RELAY_RECOMPUTE: Pipeline.P_RLD_MD,
    Option.SINGULAR: Pipeline.SINGULAR,
}


class RejectReason(StrEnum):
    """Why no option was taken; the typed reason the router returns with its rejection."""

    DEADLINE_UNREACHABLE = "deadline_unreachable"  # every allowed option ends after the deadline
    NO_OPTION = "no_option"  # nothing is allowed at all (no relay, no recompute, no line)
    TPOT_UNREACHABLE = "tpot_unreachable"  # options meet the deadlines only by breaking the TPOT bound


@dataclass(frozen=True, slots=True)
class OptionInputs:
    """``RoutingInputs`` plus what the option choice needs. Times are seconds from now.

    ``deadline_s``: time left until the request must have ended (None: no deadline).
    ``ttft_deadline_s``: time left until its first token must be out (None: no bound).
    ``p_prefill_s``: P's queue plus this prompt's prefill. ``fast_s``: the whole KV to RLD on the
    fast path. ``md_prefill``: None where MD cannot recompute. ``md_tpot_s``: MD's time per token.
    ``extend_s``: MD's extend step at a token-id handoff.
    ``tpot_bound_s``: the SLO's time per output token (None: no decode-speed bound, as before it
    existed). ``md_running``: sequences MD is decoding now (a chunked prefill rides on their decode
    steps); ``md_outputs``: the output lengths of the requests that finished lately
    (``OutputBook.lengths``; none known: every stall is charged in full); ``md_running_bounds``:
    the output bounds (``max_tokens``) of those MD runs now, where known (see
    ``expected_pushed_over``). ``rld_token_share``:
    RelayDecode's share of the output tokens produced lately (``OutputBook.rld_share``), against
    ``RoutingPolicy.rld_token_budget``. ``rld_miss_share``: of the requests relayed lately, the share
    that missed the TPOT bound (``OutputBook.relay_miss_share``): what a relay is expected to cost.
    """

    routing: RoutingInputs
    deadline_s: float | None = None
    ttft_deadline_s: float | None = None
    p_prefill_s: float = 0.0
    fast_s: float = 0.0
    md_prefill: MdPrefill | None = None
    md_tpot_s: float = 0.03
    extend_s: float = 0.0
    tpot_bound_s: float | None = None
    md_running: int = 0
    md_outputs: OutputLengths = field(default_factory=lambda: OutputLengths())
    md_runs: tuple[MdRun, ...] = ()
    rld_token_share: float = 0.0
    rld_miss_share: float = 0.0

    def __post_init__(self) -> None:
        require(self.deadline_s is None or self.deadline_s > 0, "deadline_s must be > 0 or None")
        require(self.tpot_bound_s is None or self.tpot_bound_s > 0, "tpot_bound_s must be > 0 or None")
        require(self.md_running >= 0, "md_running must be >= 0")
        require(0 <= self.rld_token_share <= 1, "rld_token_share must be in [0, 1]")
        require(0 <= self.rld_miss_share <= 1, "rld_miss_share must be in [0, 1]")
        require(self.ttft_deadline_s is None or self.ttft_deadline_s > 0, "ttft_deadline_s must be > 0")
        for name in ("p_prefill_s", "fast_s", "extend_s"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0")
        require(self.md_tpot_s > 0, "md_tpot_s must be > 0")


@dataclass(frozen=True, slots=True)
class OptionEstimate:
    """One option's expected timeline for this request, in seconds from now."""

    option: Option
    ttft_s: float
    md_ready_s: float  # MD holds the prompt's KV (inf for singular)
    finish_s: float
    rld_tokens: float  # expected tokens produced on RLD
    tpot_s: float = 0.0  # this request's expected time per output token after its first
    md_batch_tpot_s: float = 0.0  # what MD's running requests get while it recomputes, on average
    md_pushed_over: float = 0.0  # of them, how many it is expected to push over the TPOT bound
    line_s: float = 0.0  # how long the KV it ships holds the whole line (0: it ships nothing)
    hold_s: float = 0.0  # recompute: how long the router waits before sending it (``hold_for_short_runs``)

    def meets(
        self,
        deadline_s: float | None,
        ttft_deadline_s: float | None = None,
        tpot_bound_s: float | None = None,
        pushed_over_limit: float = PUSHED_OVER_LIMIT,
    ) -> bool:
        """Ends by the deadline, has its first token out by the TTFT one and keeps this request's
        TPOT within the bound and MD's running requests' too (pushing fewer than
        ``pushed_over_limit`` of them over it), each where one is given. Under a TTFT bound the KV it
        ships must also cross within it (``line_s``): a shipment that holds the line longer makes
        every request shipping behind it miss its own first token, whatever this one's is."""
        ends = deadline_s is None or self.finish_s <= deadline_s
        first = ttft_deadline_s is None or max(self.ttft_s, self.line_s) <= ttft_deadline_s
        return ends and first and self.meets_tpot(tpot_bound_s, pushed_over_limit)

    def meets_tpot(self, tpot_bound_s: float | None, pushed_over_limit: float = PUSHED_OVER_LIMIT) -> bool:
        if tpot_bound_s is None:
            return True
        return self.tpot_s <= tpot_bound_s and self.md_pushed_over < pushed_over_limit


@dataclass(frozen=True, slots=True)
class OptionDecision:
    """The choice: an option (None when rejected), why, and every estimate it was made from."""

    option: Option | None
    reason: DecisionReason | RejectReason
    wan_bytes: int  # KV bytes the WAN must carry (0 unless the option ships KV)
    wan_estimate_s: float  # the link's estimate for the missing suffix, with its backlog
    estimates: tuple[OptionEstimate, ...]
    retry_after_s: float = 0.0  # on a rejection: when the cheapest option would fit again

    @property
    def admitted(self) -> bool:
        return self.option is not None

    @property
    def hold_s(self) -> float:
        """How long the router holds the chosen option's start (a recompute's, for MD's short runs)."""
        chosen = next((e for e in self.estimates if e.option is self.option), None)
        return chosen.hold_s if chosen is not None else 0.0

    def estimate(self, option: Option) -> OptionEstimate | None:
        return next((e for e in self.estimates if e.option is option), None)


def allowed_options(inputs: OptionInputs, policy: RoutingPolicy) -> tuple[Option, ...]:
    """The options this deployment, RLD's current load and its token budget permit, before any
    timing."""
    r = inputs.routing
    recompute = policy.recompute_enabled and inputs.md_prefill is not None
    out = [Option.SHIP] + ([Option.RECOMPUTE] if recompute else [])
    if policy.rld_token_budget < 1 and inputs.rld_token_share >= policy.rld_token_budget:
        return tuple(out)  # RLD has had its share of the tokens: MD's options alone
    if policy.relay_enabled and r.rld_available and r.rld_load < policy.rld_max_load:
        out.append(Option.RELAY)
        if recompute:
            out.append(Option.RELAY_RECOMPUTE)
    rld_room = policy.relay_enabled and r.rld_available and r.rld_load < 1.0
    if rld_room and policy.allows_singular(r.max_output_tokens):
        out.append(Option.SINGULAR)
    return tuple(out)


def estimate_options(
    inputs: OptionInputs, policy: RoutingPolicy, *, certain: bool = True
) -> tuple[OptionEstimate, ...]:
    """Every allowed option's estimate. ``certain``: a run on MD bounded shorter than what a
    recompute's stall pushes over counts as pushed over for certain (``expected_pushed_over``);
    else the share of recent output decides for every run. Either way ``Option.RECOMPUTE`` holds
    its start until the short runs it would push over have ended, where that is soon
    (``hold_for_short_runs``)."""
    r = inputs.routing
    out_tokens = r.max_output_tokens
    wan_s = r.link.transfer_s(r.wan_bytes)
    ship_ready = inputs.p_prefill_s + wan_s
    # token ids cross in half a round trip; MD prefills what its own cache lacks
    recompute_ready, batch_tpot, pushed, hold, held_pushed = math.inf, 0.0, 0.0, 0.0, 0.0
    md = inputs.md_prefill
    if md is not None:
        step = inputs.md_tpot_s if inputs.md_running else 0.0
        recompute_ready = r.link.rtt_s / 2 + md.ready_s(r.missing_tokens, step)
        # charged even to an idle MD: whatever joins its batch during the prefill pays it too
        lengths = inputs.md_outputs
        batch_tpot = inputs.md_tpot_s + md.tpot_cost_s(r.missing_tokens, lengths.token_weighted_mean())
        if inputs.tpot_bound_s is not None:
            headroom = tpot_headroom_s(inputs.tpot_bound_s, inputs.md_tpot_s)
            below = md.pushed_over_below(r.missing_tokens, headroom, inputs.md_tpot_s)
            runs = inputs.md_runs
            pushed = expected_pushed_over(inputs.md_running, runs, below, lengths, certain=certain)
            hold, left = hold_for_short_runs(runs, below, inputs.md_tpot_s, md.queue_s)
            running = max(0, inputs.md_running - (len(runs) - len(left)))
            held_pushed = expected_pushed_over(running, left, below, lengths, certain=certain)
    rld_first = inputs.p_prefill_s + inputs.fast_s + r.rld_tpot_s
    rld_alone = rld_first + (out_tokens - 1) * r.rld_tpot_s
    md_decode = (out_tokens - 1) * inputs.md_tpot_s
    estimates = []
    for option in allowed_options(inputs, policy):
        ready = recompute_ready if option.recomputes else ship_ready
        # it waits behind MD's queue anyway: the router holds it only for what is past the queue
        held = max(0.0, hold - md.queue_s) if option is Option.RECOMPUTE and md is not None else 0.0
        ready += held
        if option is Option.SINGULAR:
            first, ready, finish, on_rld = rld_first, math.inf, rld_alone, float(out_tokens)
        elif option.relays:
            first = rld_first
            on_rld = min(float(out_tokens), max(0.0, (ready - rld_first) / r.rld_tpot_s) + 1)
            rest = out_tokens - on_rld
            # MD takes over once it holds the KV and RLD's first token is out: ready before that
            # first token, MD still starts from it (an estimate from ``ready`` alone put the end
            # before the first token, a negative TPOT, on a fast recompute)
            handed = max(ready, first) + inputs.extend_s
            via_md = handed + rest * inputs.md_tpot_s if rest > 0 else rld_alone
            finish = min(rld_alone, via_md)
        else:
            first, finish, on_rld = ready, ready + md_decode, 0.0
        own = (finish - first) / (out_tokens - 1) if out_tokens > 1 else 0.0
        if md is not None and inputs.tpot_bound_s is not None and option is not Option.SINGULAR:
            # MD's prefill work still queued when this request starts decoding there stalls it too
            left_s = MdPrefill(md.tokens_per_s, max(0.0, md.queue_s - ready), md.chunk_tokens)
            own += left_s.tpot_cost_s(0, out_tokens) if left_s.queue_s > 0 else 0.0
        spared = option is Option.RECOMPUTE and hold > 0
        charged, over = (batch_tpot, held_pushed if spared else pushed) if option.recomputes else (0.0, 0.0)
        line = r.wan_bytes / r.link.line_bytes_per_s if option.ships_kv else 0.0
        estimates.append(OptionEstimate(option, first, ready, finish, on_rld, own, charged, over, line, held))
    return tuple(estimates)


def choose_option(inputs: OptionInputs, policy: RoutingPolicy) -> OptionDecision:
    """Pick one option for one request, or reject it (see the module docstring). Pure and cheap."""
    r = inputs.routing
    wan_s = r.link.transfer_s(r.wan_bytes)
    every = estimate_options(inputs, policy)
    bound = inputs.tpot_bound_s
    # recompute may push over as many of MD's runs as a relay is expected to break itself: RLD shares
    # its chips with P's prefill and missed the bound on 2 of 21 relays in wan-overload's
    # conversation trace (2026-12-06, 12-24 ms a token against 10), requests that recomputing,
    # expected to push 0.02-0.06 runs over, would have served (unbounded recompute did)
    strict = max(PUSHED_OVER_LIMIT, inputs.rld_miss_share)
    fits = {e.option: e for e in every if e.meets(inputs.deadline_s, inputs.ttft_deadline_s, bound, strict)}
    if not any(o.relays for o in fits):  # no relay keeps the bounds: recompute may cost a little more
        loose = PUSHED_OVER_LIMIT_WITHOUT_RELAY
        if inputs.md_runs:  # a run known short counts for certain only where RLD can serve this one
            every = estimate_options(inputs, policy, certain=False)
        fits = {
            e.option: e for e in every if e.meets(inputs.deadline_s, inputs.ttft_deadline_s, bound, loose)
        }

    def take(option: Option, reason: DecisionReason) -> OptionDecision:
        shipped = r.wan_bytes if option.ships_kv else 0
        return OptionDecision(option, reason, shipped, wan_s, every)

    if not fits:
        return _reject(inputs, every, wan_s)
    direct = [fits[o] for o in (Option.SHIP, Option.RECOMPUTE) if o in fits]
    best_direct = min(direct, key=lambda e: (e.md_ready_s, e.option is Option.RECOMPUTE), default=None)
    threshold = policy.relay_min_wan_s
    if r.ttft_target_s is not None:
        threshold = min(threshold, r.ttft_target_s)
    # shipping uses the line that is paid for and leaves MD's chips to decode: first choice when
    # quick enough; recompute next (MD prefills, a decode-leaning chip's slower work)
    for option, reason in (
        (Option.SHIP, DecisionReason.SMALL_DELTA),
        (Option.RECOMPUTE, DecisionReason.RECOMPUTE),
    ):
        e = fits.get(option)
        if e is not None and _md_wait_s(e, inputs, wan_s) < threshold:
            return take(option, DecisionReason.RELAY_DISABLED if not policy.relay_enabled else reason)
    if not policy.relay_enabled:
        assert best_direct is not None  # relay disabled: only the direct options exist
        return take(best_direct.option, DecisionReason.RELAY_DISABLED)
    if not r.rld_available:
        return _direct_or(best_direct, fits, take, DecisionReason.RLD_UNAVAILABLE)
    singular = fits.get(Option.SINGULAR)
    if singular is not None and rld_finishes_first(r.max_output_tokens, r.rld_tpot_s, wan_s):
        return take(Option.SINGULAR, DecisionReason.SHORT_OUTPUT)
    relays = [fits[o] for o in (Option.RELAY, Option.RELAY_RECOMPUTE) if o in fits]
    if relays:
        best = min(relays, key=lambda e: (e.md_ready_s, e.option is Option.RELAY_RECOMPUTE))
        return take(best.option, DecisionReason.LARGE_DELTA)
    return _direct_or(best_direct, fits, take, DecisionReason.RLD_BUSY)


def _reject(inputs: OptionInputs, every: tuple[OptionEstimate, ...], wan_s: float) -> OptionDecision:
    """No option meets every bound: why (the deadlines, or only the TPOT bound) and a retry hint."""
    late = min((_overshoot_s(e, inputs) for e in every), default=math.inf)
    retry = max(1.0, late) if math.isfinite(late) else 5.0
    why = RejectReason.DEADLINE_UNREACHABLE if every else RejectReason.NO_OPTION
    if any(e.meets(inputs.deadline_s, inputs.ttft_deadline_s) for e in every):
        why = RejectReason.TPOT_UNREACHABLE
    return OptionDecision(None, why, 0, wan_s, every, retry_after_s=min(retry, 60.0))


def _overshoot_s(e: OptionEstimate, inputs: OptionInputs) -> float:
    """How far past its bounds an option would end: the retry hint's basis (a TPOT overshoot
    counts over this request's output)."""
    over = 0.0
    if inputs.deadline_s is not None:
        over = max(over, e.finish_s - inputs.deadline_s)
    if inputs.ttft_deadline_s is not None:
        over = max(over, e.ttft_s - inputs.ttft_deadline_s)
    if inputs.tpot_bound_s is not None:
        worst = e.tpot_s - inputs.tpot_bound_s
        over = max(over, worst * inputs.routing.max_output_tokens)
    return over


def _md_wait_s(e: OptionEstimate, inputs: OptionInputs, wan_s: float) -> float:
    """How long MD makes the client wait beyond P's prefill: the quantity ``relay_min_wan_s``
    bounds (for shipping, the WAN estimate itself, as ``choose_pipeline`` compares)."""
    if e.option is Option.SHIP:
        return wan_s
    return e.md_ready_s - inputs.p_prefill_s


def _direct_or(
    best_direct: OptionEstimate | None,
    fits: dict[Option, OptionEstimate],
    take: Callable[[Option, DecisionReason], OptionDecision],
    reason: DecisionReason,
) -> OptionDecision:
    """No relay: the MD-only option with the earlier first token, else singular alone."""
    if best_direct is not None:
        direct = (e for e in fits.values() if e.option in (Option.SHIP, Option.RECOMPUTE))
        first = min(direct, key=lambda e: (e.ttft_s, e.option is Option.RECOMPUTE))
        return take(first.option, reason)
    return take(Option.SINGULAR, DecisionReason.SHORT_OUTPUT)  # RLD busy for relays, singular fits
