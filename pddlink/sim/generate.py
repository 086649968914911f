"""Agentic traffic from a workload file: sessions whose turns share real prompt prefixes.

Prefix hits arise from structure, not from a label. Each request draws a target hit rate from the
workload's bins (skewed, or the uniform contrast case) and is built to have exactly that much prefix
in common with what came before:

- a low-hit request (below ``new_session_below_hit``) opens a new agent session: its prompt starts
  with a stretch of one of a few shared templates (system prompt, tool descriptions) and continues
  with fresh blocks;
- any other request is the next turn of a session that is ready (its previous turn arrived at least
  a turn gap ago): it keeps a leading run of the previous prompt's blocks and appends fresh ones.

The context length is chosen around the workload's typical length so that the kept blocks are
exactly the target fraction of the new prompt; whether the prefix is actually cached on the decode
side is up to the cache that sees the traffic (capacity, eviction, routing). Singular requests (very
long input, very short output bound) are drawn among the low-hit ones to match ``singular_share``.
Arrivals are Poisson. Lazy: ``generate`` yields requests one at a time, so an hour of traffic never
sits in memory.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass

from pddlink.errors import ConfigError
from pddlink.sim.trace import Trace, TraceMeta, TraceRequest
from pddlink.sim.workload import HitBin, Workload


@dataclass(frozen=True, slots=True)
class GeneratorConfig:
    rate_rps: float
    duration_s: float | None = None
    requests: int | None = None
    seed: int = 0
    uniform_hits: bool = False  # the "every request hits 85-95%" contrast case
    block_tokens: int = 512
    context_tokens: int | None = None  # default: the workload's typical context
    context_spread: float = 0.2  # context drawn uniformly within +-spread of the typical length
    turn_gap_s: tuple[float, float] = (20.0, 60.0)
    templates: int = 16
    new_session_below_hit: float = 0.3
    singular_max_tokens: int = 16
    hit_bins: tuple[HitBin, ...] | None = None  # overrides the workload's (and uniform_hits)

    def __post_init__(self) -> None:
        if self.rate_rps <= 0:
            raise ConfigError(f"rate_rps must be > 0, got {self.rate_rps}")
        if (self.duration_s is None) == (self.requests is None):
            raise ConfigError("give exactly one of duration_s and requests")
        if self.block_tokens < 1 or self.templates < 1 or self.singular_max_tokens < 1:
            raise ConfigError("block_tokens, templates and singular_max_tokens must be >= 1")
        if not 0 <= self.context_spread < 1:
            raise ConfigError(f"context_spread must be in [0, 1), got {self.context_spread}")
        lo, hi = self.turn_gap_s
        if not 0 <= lo <= hi:
            raise ConfigError(f"turn_gap_s must be 0 <= lo <= hi, got {self.turn_gap_s}")


@dataclass(slots=True)
class _Session:
    session_id: int
    blocks: tuple[int, ...]
    full_blocks: int


def within_bin_exponent(bins: tuple[HitBin, ...], mean_target: float | None) -> float:
    """Exponent ``a`` of the within-bin draw ``lo + (hi - lo) * u ** (1 / a)`` (density rising toward
    ``hi`` for a > 1) that makes the mean hit equal ``mean_target``; 1.0 (uniform) without a target
    or when the bins cannot reach it."""
    if mean_target is None:
        return 1.0

    def mean(a: float) -> float:
        return float(sum(b.share * (b.lo + (b.hi - b.lo) * a / (a + 1)) for b in bins))

    lo, hi = 0.05, 50.0
    if not mean(lo) <= mean_target <= mean(hi):
        return 1.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if mean(mid) < mean_target else (lo, mid)
    return float(lo)


class _Sampler:
    """Inverse-CDF draws for hit rates and output lengths."""

    def __init__(
        self, rng: random.Random, bins: tuple[HitBin, ...], workload: Workload, mean_target: float | None
    ) -> None:
        self.rng = rng
        self.bins = bins
        self.inv_a = 1.0 / within_bin_exponent(bins, mean_target)
        self.bin_cdf = [0.0]
        for b in bins:
            self.bin_cdf.append(self.bin_cdf[-1] + b.share)
        self.out_tokens = [1.0] + [float(p.tokens) for p in workload.output_cdf]
        self.out_cdf = [0.0] + [p.cdf for p in workload.output_cdf]

    def hit(self) -> float:
        u = self.rng.random() * self.bin_cdf[-1]
        b = self.bins[min(len(self.bins) - 1, bisect.bisect_right(self.bin_cdf, u) - 1)]
        return b.lo + (b.hi - b.lo) * float(self.rng.random() ** self.inv_a)

    def output_tokens(self) -> int:
        u = self.rng.random()
        i = max(1, bisect.bisect_left(self.out_cdf, u))
        c0, c1 = self.out_cdf[i - 1], self.out_cdf[i]
        t0, t1 = self.out_tokens[i - 1], self.out_tokens[i]
        frac = 0.0 if c1 == c0 else (u - c0) / (c1 - c0)
        return max(1, round(t0 + frac * (t1 - t0)))


class _Builder:
    """Allocates block ids and keeps the sessions and templates prompts are built from."""

    def __init__(self, workload: Workload, config: GeneratorConfig, rng: random.Random) -> None:
        self.cfg, self.rng = config, rng
        self.context = config.context_tokens or workload.context_tokens
        self.block_tokens = config.block_tokens
        self.spread_lo, self.spread_w = 1 - config.context_spread, 2 * config.context_spread
        self.next_block = 0
        self.next_session = 0
        self.templates: list[list[int]] = [[] for _ in range(config.templates)]
        self.waiting: list[tuple[float, int, _Session]] = []  # (ready_s, id, session)
        self.ready: list[_Session] = []
        self.max_ready = max(64, int(config.rate_rps * config.turn_gap_s[1]))

    def fresh(self, n: int) -> list[int]:
        start = self.next_block
        self.next_block += n
        return list(range(start, start + n))

    def template(self, n_blocks: int) -> list[int]:
        # Zipf-like popularity: a few templates carry most sessions.
        k = min(len(self.templates) - 1, int(len(self.templates) * self.rng.random() ** 2))
        t = self.templates[k]
        if len(t) < n_blocks:
            t.extend(self.fresh(n_blocks - len(t)))
        return t[:n_blocks]

    def promote(self, now: float) -> None:
        waiting, ready = self.waiting, self.ready
        while waiting and waiting[0][0] <= now:
            ready.append(heapq.heappop(waiting)[2])
        if len(ready) > self.max_ready:  # abandoned sessions: drop the oldest
            del ready[: len(ready) - self.max_ready]

    def take_ready(self) -> _Session | None:
        if not self.ready:
            return None
        i = self.rng.randrange(len(self.ready))
        self.ready[i], self.ready[-1] = self.ready[-1], self.ready[i]
        return self.ready.pop()

    def prompt(self, prefix: list[int] | tuple[int, ...], hit: float) -> tuple[tuple[int, ...], int]:
        """Blocks and length of a prompt whose first ``len(prefix)`` blocks are ``hit`` of it."""
        b = self.block_tokens
        length = max(1, round(self.context * (self.spread_lo + self.spread_w * self.rng.random())))
        kept = min(len(prefix), round(hit * length / b))
        if kept > 0 and hit > 0:
            length = max(kept * b + 1, round(kept * b / hit))
        new_blocks = -(-(length - kept * b) // b)
        start = self.next_block
        self.next_block += new_blocks
        return (*prefix[:kept], *range(start, start + new_blocks)), length

    def park(self, session: _Session, now: float) -> None:
        lo, hi = self.cfg.turn_gap_s
        heapq.heappush(self.waiting, (now + lo + (hi - lo) * self.rng.random(), session.session_id, session))

    def new_session_id(self) -> int:
        self.next_session += 1
        return self.next_session - 1


def generate(workload: Workload, config: GeneratorConfig) -> Iterator[TraceRequest]:
    """Yield requests in arrival order (lazily)."""
    rng = random.Random(config.seed)
    bins = workload.uniform_bins if config.uniform_hits else workload.hit_bins
    if config.hit_bins is not None:
        bins = config.hit_bins
    sampler = _Sampler(rng, bins, workload, workload.hit_mean_target)
    build = _Builder(workload, config, rng)
    low_share = sum(b.share * min(1.0, max(0.0, (0.7 - b.lo) / max(1e-12, b.hi - b.lo))) for b in bins)
    singular_p = min(1.0, workload.singular_share / low_share) if low_share > 0 else 0.0
    max_tokens = workload.output_cdf[-1].tokens
    now, index = 0.0, 0
    while True:
        if config.requests is not None and index >= config.requests:
            return
        now += rng.expovariate(config.rate_rps)
        if config.duration_s is not None and now > config.duration_s:
            return
        build.promote(now)
        hit = sampler.hit()
        session = None if hit < config.new_session_below_hit else build.take_ready()
        if session is None:
            prefix: list[int] | tuple[int, ...] = build.template(
                round(hit * build.context / config.block_tokens) + 1
            )
            session = _Session(build.new_session_id(), (), 0)
        else:
            prefix = session.blocks[: session.full_blocks]
        blocks, length = build.prompt(prefix, hit)
        singular = hit < 0.7 and rng.random() < singular_p
        if singular:
            bound = rng.randint(1, config.singular_max_tokens)
            output = rng.randint(1, bound)
        else:
            bound, output = max_tokens, sampler.output_tokens()
            session.blocks, session.full_blocks = blocks, length // config.block_tokens
            build.park(session, now)
        yield TraceRequest(index, now, session.session_id, blocks, length, output, bound)
        index += 1


def mixed_bins(workload: Workload, skew: float) -> tuple[HitBin, ...]:
    """``skew`` of the published skewed bins and ``1 - skew`` of the uniform contrast bins."""
    if not 0 <= skew <= 1:
        raise ConfigError(f"skew must be in [0, 1], got {skew}")
    out = [HitBin(b.lo, b.hi, b.share * skew) for b in workload.hit_bins]
    out += [HitBin(b.lo, b.hi, b.share * (1 - skew)) for b in workload.uniform_bins]
    return tuple(b for b in out if b.share > 0)


def generate_trace(workload: Workload, config: GeneratorConfig) -> Trace:
    kind = "uniform" if config.uniform_hits else "skewed"
    source = f"{workload.name} {kind} rate={config.rate_rps} seed={config.seed}"
    return Trace(TraceMeta(config.block_tokens, source), tuple(generate(workload, config)))
