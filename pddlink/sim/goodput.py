"""Goodput as a capacity: the highest offered rate a deployment sustains while meeting the SLA.

SLA goodput measured at one offered load is fragile: where a deployment sits on a knee (intra-DC PD
on the TPOT bound near its decode capacity) a small change of seed moves its attainment a lot, and
a deployment with headroom gets no credit for it. Here a deployment's goodput is the offered rate
it carries within the SLA, found by bisection on short runs of the same workload:

- a probe generates ``prewarm_s + warmup_s + window_s`` of traffic at rate ``r`` (same seed), runs
  the real simulation and calls ``r`` sustained when at least ``attainment`` of the measured
  requests meet both the TTFT and the TPOT bound, both over the whole window and over its last
  third (a queue that grows through the window fails there first), and - for a deployment that
  crosses the WAN - the KV bytes its requests put on the line stay below ``max_line_load`` of what
  the line carries (at or above 1 the line's backlog grows without bound, however slowly a short
  window shows it: processor sharing keeps small transfers fast while the large ones starve);
- ``steps`` halvings of ``[lo_rps, hi_rps]`` give the rate to within ``(hi - lo) / 2 ** steps``
  (``lo_rps`` itself is not probed: if no probe passes, the goodput is reported as 0);
  the reported goodput is ``rate * attainment`` measured at the highest sustained probe, so it is
  still "requests per second that met the SLA".

Lifecycle: pure function of its inputs; each probe is an independent ``Simulation``.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from pddlink.errors import ConfigError
from pddlink.sim.deploy import Deployment
from pddlink.sim.engine import Simulation
from pddlink.sim.generate import GeneratorConfig, generate
from pddlink.sim.records import Record, RunRecords, Sla
from pddlink.sim.trace import TraceRequest
from pddlink.sim.workload import HitBin, Workload


@dataclass(frozen=True, slots=True)
class RateSearch:
    lo_rps: float
    hi_rps: float
    steps: int = 6
    window_s: float = 150.0
    warmup_s: float = 60.0
    prewarm_s: float = 120.0
    attainment: float = 0.9  # share of requests within both bounds for the rate to count as met
    max_line_load: float = 0.95  # offered WAN bytes / line capacity above which a rate is not sustained

    def __post_init__(self) -> None:
        if not 0 < self.lo_rps < self.hi_rps:
            raise ConfigError(f"rate search needs 0 < lo_rps < hi_rps, got {self.lo_rps}, {self.hi_rps}")
        if self.steps < 1 or self.window_s <= 0 or self.warmup_s < 0 or self.prewarm_s < 0:
            raise ConfigError("rate search: steps >= 1, window_s > 0, warmup_s and prewarm_s >= 0")
        if not 0 < self.attainment <= 1 or not 0 < self.max_line_load <= 1:
            raise ConfigError("attainment and max_line_load must be in (0, 1]")

    @property
    def duration_s(self) -> float:
        return self.prewarm_s + self.warmup_s + self.window_s


def attainment(records: RunRecords, sla: Sla, since_s: float = 0.0) -> float:
    """Share of the measured, finished requests arriving at or after ``since_s`` that meet the SLA."""
    met = total = 0
    for r in records.records:
        if not r.measured or r.arrival_s < since_s:
            continue
        total += 1
        if r.finish_s < 0:
            continue
        ttft = r.first_token_s - r.arrival_s
        tpot = (r.finish_s - r.first_token_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        met += ttft <= sla.ttft_s and tpot <= sla.tpot_s
    return met / total if total else 0.0


def line_load(records: RunRecords, deployment: Deployment, window_s: float) -> float:
    """KV bytes the measured requests put on the WAN, over what the line carries in ``window_s``."""
    if not deployment.crosses_wan:
        return 0.0
    tokens = sum(r.missing_tokens for r in records.records if r.measured and _ships(r))
    return tokens * deployment.kv_bytes_per_token / (deployment.link.wan_bytes_s * window_s)


def _ships(r: Record) -> bool:
    """Its missing suffix crossed the line: not singular, not recomputed on MD, not rejected."""
    return r.option is not None and r.option.ships_kv


def probe(
    deployment: Deployment,
    requests: Sequence[TraceRequest],
    block_tokens: int,
    sla: Sla,
    search: RateSearch,
) -> tuple[float, float, float]:
    """Run one probe: attainment over the window and over its last third, and the line's load."""
    warm_end = search.prewarm_s + search.warmup_s
    records = Simulation(deployment, block_tokens).run(
        requests, warmup_s=warm_end, prewarm_s=search.prewarm_s
    )
    tail_from = warm_end + search.window_s * 2 / 3
    return (
        attainment(records, sla),
        attainment(records, sla, tail_from),
        line_load(records, deployment, search.window_s),
    )


def sustained_goodput(
    deployment: Deployment,
    requests_at: Callable[[float], Sequence[TraceRequest]],
    block_tokens: int,
    sla: Sla,
    search: RateSearch,
) -> dict[str, Any]:
    """Bisect for the highest sustained rate; ``requests_at(rate)`` builds a probe's traffic."""
    lo, hi = search.lo_rps, search.hi_rps
    best_rate, best_share = 0.0, 0.0
    probes: list[list[float]] = []

    def run(rate: float) -> bool:
        nonlocal best_rate, best_share
        whole, tail, load = probe(deployment, requests_at(rate), block_tokens, sla, search)
        probes.append([round(rate, 3), round(whole, 4), round(tail, 4), round(load, 4)])
        ok = min(whole, tail) >= search.attainment and load <= search.max_line_load
        if ok and rate > best_rate:
            best_rate, best_share = rate, whole
        return ok

    for _ in range(search.steps):  # lo is taken as sustained; if none is, goodput is 0
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return {
        "goodput_rps": round(best_rate * best_share, 4),
        "sustained_rps": round(best_rate, 3),
        "probes": probes,  # [offered rps, attainment, over the last third, line load]
    }


@dataclass(frozen=True, slots=True)
class GeneratedTraffic:
    """A probe's traffic: the workload generator at a given rate (picklable, for worker processes)."""

    workload: Workload
    seed: int
    block_tokens: int
    duration_s: float
    hit_bins: tuple[HitBin, ...] | None = None  # None: the workload's own

    def __call__(self, rate: float) -> tuple[TraceRequest, ...]:
        config = GeneratorConfig(
            rate_rps=rate, duration_s=self.duration_s, seed=self.seed, block_tokens=self.block_tokens,
            hit_bins=self.hit_bins,
        )  # fmt: skip
        return tuple(generate(self.workload, config))


def _search_one(
    deployment: Deployment, traffic: GeneratedTraffic, sla: Sla, search: RateSearch
) -> dict[str, Any]:
    return sustained_goodput(deployment, traffic, traffic.block_tokens, sla, search)


def sustained_goodputs(
    deployments: Sequence[Deployment],
    traffic: GeneratedTraffic,
    sla: Sla,
    search: RateSearch,
    workers: int,
) -> tuple[Future[dict[str, Any]], ...]:
    """Start one rate search per deployment in ``workers`` processes; the caller collects the
    futures (and may simulate meanwhile). ``workers <= 1`` runs them here, one after another."""
    if workers <= 1:
        done = []
        for d in deployments:
            f: Future[dict[str, Any]] = Future()
            f.set_result(_search_one(d, traffic, sla, search))
            done.append(f)
        return tuple(done)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
    futures = tuple(pool.submit(_search_one, d, traffic, sla, search) for d in deployments)
    pool.shutdown(wait=False)
    return futures


def bounded_lead(
    rows: Sequence[dict[str, Any]], over: str, key: str = "goodput_rps", bounded: str = "pdd_bounded"
) -> list[dict[str, Any]]:
    """At each value of ``over`` (a sweep's rows, one per deployment and point): the bounded
    policy's ``key`` against the best other WAN deployment's (intra-DC PD, the normaliser, left
    out), and by how much it leads (negative: it trails)."""
    points: dict[float, dict[str, float]] = {}
    for r in rows:
        points.setdefault(float(r[over]), {})[str(r["deployment"])] = float(r[key])
    out = []
    for x, by in sorted(points.items()):
        others = {n: v for n, v in by.items() if n not in (bounded, "intra_dc_pd")}
        if bounded not in by or not others:
            continue
        best = max(others, key=lambda n: others[n])
        out.append({
            over: x, "bounded": by[bounded], "best_other": best, "best_other_value": others[best],
            "lead": round(by[bounded] - others[best], 4),
        })  # fmt: skip
    return out
