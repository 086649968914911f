"""Benefit per cost against the mean prefix hit rate (the published "bathtub"), per policy.

``run_bathtub`` draws every request's hit from a narrow band around each mean (``hit_band``) and
compares intra-DC PD with the four policies of ``pddlink.sim.wan_load.policy_variants`` on the
paper's line. Goodput at one offered rate would say more about the rate than about the hit rate
(at low hits the P pool, the same in every deployment, saturates and a queue-bound deployment
reports nothing), so each deployment's goodput here is the highest rate it sustains within both
SLOs (``pddlink.sim.goodput``'s search on short probes, ``BATHTUB_SEARCH``) times its attainment,
and BCR is that goodput per cost over intra-DC PD's at the same hit rate. The figures at the
offered ``rate_rps`` stay beside it (``offered_goodput_rps``, TTFT, TPOT). ``valley`` says where
each WAN policy's BCR is lowest and how far the bounded policy lifts that floor above the best floor
of the others; ``bounded_lead`` compares it point by point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pddlink.errors import ConfigError
from pddlink.sim.generate import GeneratorConfig, generate
from pddlink.sim.goodput import GeneratedTraffic, RateSearch, bounded_lead, sustained_goodputs
from pddlink.sim.records import Sla
from pddlink.sim.scenario import PaperKnobs, paper_deployments, run_deployments, sla_of, use_sustained_goodput
from pddlink.sim.wan_load import MD_CHUNK_TOKENS, ROW_KEYS, policy_variants
from pddlink.sim.workload import HitBin, Workload

BATHTUB_HITS = (0.05, 0.25, 0.5, 0.7, 0.85, 0.95, 0.99)
HALF_BAND = 0.05


def hit_band(mean: float, half: float = HALF_BAND) -> tuple[HitBin, ...]:
    """Every request's hit drawn uniformly within ``mean +- half`` (clipped to [0, 1])."""
    if not 0 <= mean <= 1:
        raise ConfigError(f"a mean hit rate must be in [0, 1], got {mean}")
    lo, hi = max(0.0, mean - half), min(1.0, mean + half)
    return (HitBin(lo, hi, 1.0),)


BATHTUB_SEARCH = RateSearch(
    lo_rps=0.25, hi_rps=24.0, steps=6, window_s=300.0, warmup_s=120.0, prewarm_s=120.0
)


def run_bathtub(
    workload: Workload,
    k: PaperKnobs,
    hits: Sequence[float] = BATHTUB_HITS,
    progress: Callable[[str], None] | None = None,
    sla: Sla | None = None,
    md_chunk_tokens: int = MD_CHUNK_TOKENS,
    search: RateSearch = BATHTUB_SEARCH,
) -> dict[str, Any]:
    """One row per (deployment, mean hit): sustained goodput, cost, BCR, and the ``wan_load``
    figures at ``k.rate_rps`` offered."""
    sla = sla or sla_of(workload)
    deps = policy_variants(paper_deployments(workload, k), sla, md_chunk_tokens, keep_intra=True)
    rows = []
    for hit in hits:
        if progress:
            progress(f"mean hit {hit:g}")
        bins = hit_band(hit)
        config = GeneratorConfig(
            rate_rps=k.rate_rps, duration_s=k.prewarm_s + k.duration_s, seed=k.seed,
            block_tokens=k.block_tokens, hit_bins=bins,
        )  # fmt: skip
        result, _ = run_deployments(
            tuple(generate(workload, config)), deps, block_tokens=k.block_tokens, sla=sla,
            prewarm_s=k.prewarm_s, warmup_s=k.warmup_s,
        )  # fmt: skip
        traffic = GeneratedTraffic(workload, k.seed, k.block_tokens, search.duration_s, bins)
        found = sustained_goodputs(deps, traffic, sla, search, workers=1)
        use_sustained_goodput(result, {d.name: f.result() for d, f in zip(deps, found, strict=True)})
        for name, d in result["deployments"].items():
            keep = {
                f: d[f]
                for f in ("cost", "bcr", "mean_hit", "sustained_rps", "offered_goodput_rps", *ROW_KEYS)
            }
            rows.append({"deployment": name, "hit": hit, **keep})
    return {
        "rate_rps": k.rate_rps, "wan_gbps": k.wan_gbps, "md_chunk_tokens": md_chunk_tokens,
        "slo": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s},
        "search": {"lo_rps": search.lo_rps, "hi_rps": search.hi_rps, "steps": search.steps,
                   "window_s": search.window_s, "attainment": search.attainment},
        "rows": rows, "valley": valley(rows), "bounded_lead": bounded_lead(rows, "hit", key="bcr"),
    }  # fmt: skip


def valley(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each WAN policy's lowest BCR over the hit rates and where it lies; ``floor_lift``: the
    bounded policy's floor over the best floor of the others."""
    floors: dict[str, dict[str, float]] = {}
    for r in rows:
        name = str(r["deployment"])
        if name == "intra_dc_pd":
            continue
        low = floors.get(name)
        if low is None or r["bcr"] < low["bcr"]:
            floors[name] = {"bcr": float(r["bcr"]), "hit": float(r["hit"])}
    others = [v["bcr"] for n, v in floors.items() if n != "pdd_bounded"]
    lift = floors["pdd_bounded"]["bcr"] - max(others) if "pdd_bounded" in floors and others else None
    return {"floors": floors, "floor_lift": None if lift is None else round(lift, 4)}
