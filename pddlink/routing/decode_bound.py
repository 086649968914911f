"""The decode-speed bound of the option policy (``pddlink.routing.options``): what recomputing on MD
costs the requests MD decodes meanwhile, and how many of them it may push over the SLO's TPOT.

A decode-speed bound (``OptionInputs.tpot_bound_s``, the SLO's time per output token) adds a second
half to an option's "meets": this request's own expected TPOT, and the TPOT of the requests MD
decodes while it recomputes (those running, ``md_running``, and those that join during the prefill),
stay within it. Recompute costs them MD's prefill time: a blocking prefill stalls one step for the
whole prompt (and what is queued before it), adding ``work / n`` to the mean TPOT of a running
request of ``n`` output tokens; chunked prefill (``MdPrefill.chunk_tokens``, a per-step token
budget) lengthens each step by ``chunk / tokens_per_s`` while it lasts, so at most that. Either way
a request is pushed over the bound when it is shorter than ``work / slack``
(``MdPrefill.pushed_over_below``; ``slack``: ``tpot_headroom_s``, the bound less MD's time per token
with a reserve; a prefill no longer than one decode step pushes nobody over, whatever the slack).
The requests MD is decoding are length-biased (a request runs as long as its output), so the share
of them that short is the share of output *tokens* that belong to such requests (``OutputLengths``,
from what requests produced lately), and one whose output bound is that short counts for certain
while a relay option keeps every bound (``expected_pushed_over``). Recompute keeps the bound while
the requests it is expected to push over (that share of ``md_running``; an idle MD pushes nobody
over: a request that joins during the prefill is judged by its own estimate, which counts MD's
prefill queue) stay under ``PUSHED_OVER_LIMIT`` (0.02) while a relay option keeps every bound, else
under ``PUSHED_OVER_LIMIT_WITHOUT_RELAY`` (1: serving this request is worth more than what it costs
the others). Counting one request on an idle MD, as before, refused every low-hit prompt once MD's
own step neared the bound (slack near 0: the simulator's demo-overload at half the engine's speed
refused 199 of 200 while recompute without the bound served 38 within the SLO). A mean output length
instead undercounts the short requests a stall breaks, and a low quantile of outputs (8 tokens in
the demo) refused every low-hit prompt, which RelayDecode then decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pddlink.errors import require
from pddlink.routing.outputs import OutputLengths

# The share of the bound a running request keeps, in the simulator's measure, for what a single
# stall's judgement cannot see: the other stalls of its life and the spread of the TPOT around the
# mean it is judged by (see ``tpot_headroom_s``).
RESERVED_SHARE_OF_BOUND = 0.1
# Near the bound: the share of what is left that one stall may take.
STALL_SHARE_OF_HEADROOM = 0.5


def tpot_headroom_s(tpot_bound_s: float, tpot_s: float) -> float:
    """How much one stall may add to the TPOT of a request MD decodes at ``tpot_s`` per token
    before it breaks ``tpot_bound_s``.

    A request's TPOT is its decode time over its ``n`` output tokens. With ``r`` left, having
    decoded at ``tpot_s`` so far and going on so, a stall of ``S`` ends it at ``(n * tpot_s + S) /
    n``: within the bound while ``S / r <= (n / r) * (bound - tpot_s)`` (the stall spread over the
    tokens left against the bound's headroom for them, which includes what the tokens already out
    saved), that is while ``S <= n * (bound - tpot_s)``: a stall pushes over exactly the requests
    shorter than ``S / headroom`` (``MdPrefill.pushed_over_below``), whatever their progress, with
    ``headroom = bound - tpot_s`` for a request that sees this stall alone.

    A running request sees more than one: each recompute is judged alone, and a ``tpot_s`` that
    is a mean leaves a tail above it. Judged against the whole ``bound - tpot_s``, the simulator's
    wan-load sweep (bound 30 ms) recomputed until MD's TPOT P90 reached the bound (29.7-30.3 ms)
    and its goodput fell below shipping's (7.17 against 7.68 req/s at 0.5x the line, 5.40 against
    6.24 with the reserve at 2x). So the rule keeps a reserve: ``RESERVED_SHARE_OF_BOUND`` of the
    bound while MD is well below it (``0.9 * bound - tpot_s``, the rule before), and at least
    ``1 - STALL_SHARE_OF_HEADROOM`` of the whole headroom whatever ``tpot_s`` (the rule before
    gave none from ``tpot_s = 0.9 * bound`` on and counted every running request as pushed over:
    wan-overload 2026-12-04, MD near 9 ms against a 10 ms bound). Negative (none at all) only
    once ``tpot_s`` is past the bound."""
    whole = tpot_bound_s - tpot_s
    if whole <= 0:
        return whole
    return max((1 - RESERVED_SHARE_OF_BOUND) * tpot_bound_s - tpot_s, STALL_SHARE_OF_HEADROOM * whole)


# How many of MD's running requests (expected) a recompute may push over the bound: while a relay
# option keeps every bound, hardly any (RLD serves the request without harming anyone); without
# one, fewer than the one request it serves (the alternative is refusing it). At 0.1 the
# simulator's wan-load sweep (SLO TPOT 30 ms) recomputed 458 requests at 1x the line where shipping
# and relaying served them, and its goodput fell 1.03% under PDD's without recompute (7.83 against
# 7.91 req/s); at 0.02 it recomputes where the line cannot carry the suffix: 7.92 at 1x, within
# 0.7% of the best at 0.5x, and 1.1-2.2 req/s above the best other policy from 1.5x to 3x.
PUSHED_OVER_LIMIT = 0.02
PUSHED_OVER_LIMIT_WITHOUT_RELAY = 1.0

# The longest a recompute waits before MD starts it, so that the short requests its stall would push
# over end first (``hold_for_short_runs``). A hold moves no work off MD (it decodes meanwhile) and
# costs this request's first token as much; 0.1 s is a twentieth of the demo's 2 s TTFT SLO and
# covers a run of up to 25 tokens at 4 ms a token.
MAX_HOLD_S = 0.1


@dataclass(frozen=True, slots=True)
class MdPrefill:
    """MD's ability to recompute: its prefill speed, the prefill work already queued there,
    ``chunk_tokens``: the per-step prompt-token budget of an engine with chunked prefill (None:
    the engine prefills a prompt in one step, stalling every sequence it decodes meanwhile), and
    ``fixed_s``: what a prefill costs whatever its length (``PrefillBook``'s fit): a prefill of
    ``tokens`` takes ``fixed_s + tokens / tokens_per_s``."""

    tokens_per_s: float
    queue_s: float = 0.0
    chunk_tokens: int | None = None
    fixed_s: float = 0.0

    def __post_init__(self) -> None:
        require(self.tokens_per_s > 0, f"tokens_per_s must be > 0, got {self.tokens_per_s}")
        require(self.queue_s >= 0, f"queue_s must be >= 0, got {self.queue_s}")
        require(self.chunk_tokens is None or self.chunk_tokens >= 1, "chunk_tokens must be >= 1 or None")
        require(self.fixed_s >= 0, f"fixed_s must be >= 0, got {self.fixed_s}")

    def work_s(self, tokens: int) -> float:
        """MD's prefill time for ``tokens`` after its queue (0 tokens: the queue alone)."""
        own = self.fixed_s + tokens / self.tokens_per_s if tokens > 0 else 0.0
        return self.queue_s + own

    def ready_s(self, tokens: int, step_s: float = 0.0) -> float:
        """When MD holds ``tokens`` prefilled: after its queue; chunked, each of the prefill's steps
        also runs one decode iteration of ``step_s`` (0 when MD decodes nothing)."""
        ready = self.work_s(tokens)
        if self.chunk_tokens is not None and tokens > 0:
            ready += math.ceil(tokens / self.chunk_tokens) * step_s
        return ready

    def pushed_over_below(self, tokens: int, headroom_s: float, step_s: float = 0.0) -> float:
        """The output length under which a request MD decodes meanwhile is pushed over the TPOT
        bound by prefilling ``tokens`` (after MD's queue), given ``headroom_s`` (``tpot_headroom_s``:
        the bound less its TPOT): ``stall / headroom``, or 0 when chunks are short enough to fit
        in the headroom at every step, or when the work is no longer than one decode step
        ``step_s`` (it costs a running request what one more token in the batch does, within the
        step time's own spread); inf: no headroom at all."""
        work = self.work_s(tokens)
        if work <= step_s:
            return 0.0
        if headroom_s <= 0:
            return math.inf
        if self.chunk_tokens is not None and self.chunk_tokens / self.tokens_per_s <= headroom_s:
            return 0.0
        return work / headroom_s

    def tpot_cost_s(self, tokens: int, over_tokens: float) -> float:
        """What prefilling ``tokens`` adds to the time per output token of a request of
        ``over_tokens`` output tokens MD decodes meanwhile: the prefill and what is queued before it
        stall it (blocking: all of it; chunked: one chunk per step while it lasts, so at most one
        chunk's time per token), spread over its tokens."""
        work = self.work_s(tokens)
        spread = work / max(1.0, over_tokens)
        return spread if self.chunk_tokens is None else min(self.chunk_tokens / self.tokens_per_s, spread)


@dataclass(frozen=True, slots=True)
class MdRun:
    """A request MD decodes now, as the router knows it: its output bound (``max_tokens``) and the
    tokens it has produced so far. Its output is at least ``produced`` and at most ``bound``
    tokens, so it has at most ``left`` to go."""

    bound: int
    produced: int = 0

    def __post_init__(self) -> None:
        require(self.bound >= 1, f"bound must be >= 1, got {self.bound}")
        require(self.produced >= 0, f"produced must be >= 0, got {self.produced}")

    @property
    def left(self) -> int:
        return max(0, self.bound - self.produced)


def expected_pushed_over(
    running: int, runs: tuple[MdRun, ...], below: float, lengths: OutputLengths, *, certain: bool = True
) -> float:
    """How many of the ``running`` requests MD decodes a stall is expected to push over the TPOT
    bound, where it pushes over those shorter than ``below`` tokens: with ``certain``, each of the
    ``runs`` bounded under ``below`` for certain (it ends within its bound); the others by the
    share of recent output tokens in requests that short (``OutputLengths``).

    The share alone let a recompute stall a request known to be short: the wan-overload
    conversation trace (2026-12-06) lost 1-3 requests a run of 8-12 output tokens to one or two
    recomputes of 70-200 ms started while they decoded (TPOT 13-21 ms against 10), in the
    bounded run and the unbounded one alike, since 8-token requests hold too few of the tokens
    for the share to see them.

    A run's progress does not lower the count, though one that has produced ``below`` tokens is
    longer than this stall breaks: each stall is judged alone, and the share is what stands for
    the others a long request sees over its life. Counting such runs as safe recomputed more and
    lost goodput in the simulator's wan-load sweep (5.18 against 6.23 req/s at 2x the line)."""
    # ``certain`` only where a relay option keeps every bound (``choose_option``): without one,
    # refusing this request to spare one that may be pushed over trades a request for a request,
    # and the same trace refused 2 a run that unbounded recompute served within the SLO (pushed
    # 1.04 and 1.28)
    short = sum(1 for r in runs if r.bound < below) if certain else 0
    sure = min(running, short)
    return sure + (running - sure) * lengths.token_share_below(below)


def hold_for_short_runs(
    runs: tuple[MdRun, ...], below: float, tpot_s: float, queue_s: float = 0.0, max_hold_s: float = MAX_HOLD_S
) -> tuple[float, tuple[MdRun, ...]]:
    """How long MD should hold a recompute (``Option.RECOMPUTE``) so that the requests it decodes
    which the stall would push over for certain (output bound under ``below`` tokens) end before it
    starts, where that holds it at most ``max_hold_s`` past MD's prefill queue (``queue_s``, which it
    waits behind anyway): when the last spared run ends, from now (0: none to spare; the router
    waits what of it is past the queue, ``OptionEstimate.hold_s``), and the runs still decoding
    when it starts (those ending by then gone).

    A run that has produced tokens decodes now and ends within ``MdRun.left`` tokens at ``tpot_s``;
    one that has produced none is still in MD's queue (or on RLD) and ends that long after the queue.
    Both are upper estimates. Without the hold, the wan-overload conversation trace (2026-12-06) lost
    3 requests a run of 8-9 output tokens (TPOT 11-16 ms against 10) to recomputes of 40-180 ms
    started while they decoded, where no relay option was open to spare them otherwise; holding
    only for a run's own tokens left one of them stalled 96 ms, decided while its prefill was still
    queued."""

    def end_s(r: MdRun) -> float:
        return r.left * tpot_s + (queue_s if r.produced == 0 else 0.0)

    spared = [end_s(r) for r in runs if r.bound < below and end_s(r) - queue_s <= max_hold_s]
    if not spared:
        return 0.0, runs
    hold = max(spared)
    return hold, tuple(r for r in runs if end_s(r) > hold)
