"""Benefit per cost against the mean prefix hit rate (the published "bathtub"), per policy.

``run_bathtub`` replays the paper traffic with every request's hit drawn from a narrow band around
each mean (``hit_band``) through intra-DC PD and the four policies of
``pddlink.sim.wan_load.policy_variants`` on the paper's line, and reports goodput, cost and BCR per
point: goodput per cost over intra-DC PD's on the workload's own (published) hits, one fixed
reference, so points compare across hit rates. ``valley`` says where each policy's BCR is lowest
and how far the bounded policy lifts that floor above the best floor of the others;
``bounded_lead`` compares it point by point. At a fixed offered rate the P pool, the same in every
deployment, saturates as the hit rate falls: MD recomputing within the TPOT bound is the one way
the decode side takes prefill work off it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pddlink.errors import ConfigError
from pddlink.sim.deploy import Deployment
from pddlink.sim.generate import GeneratorConfig, generate
from pddlink.sim.goodput import bounded_lead
from pddlink.sim.records import Sla
from pddlink.sim.scenario import PaperKnobs, paper_deployments, run_deployments, sla_of
from pddlink.sim.trace import TraceRequest
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


def run_bathtub(
    workload: Workload,
    k: PaperKnobs,
    hits: Sequence[float] = BATHTUB_HITS,
    progress: Callable[[str], None] | None = None,
    sla: Sla | None = None,
    md_chunk_tokens: int = MD_CHUNK_TOKENS,
) -> dict[str, Any]:
    """One row per (deployment, mean hit): goodput, cost, BCR and the ``wan_load`` figures."""
    sla = sla or sla_of(workload)
    deps = policy_variants(paper_deployments(workload, k), sla, md_chunk_tokens, keep_intra=True)
    reference = _reference_efficiency(workload, k, deps[0], sla)
    rows = []
    for hit in hits:
        if progress:
            progress(f"mean hit {hit:g}")
        requests = _traffic(workload, k, hit_band(hit))
        result, _ = run_deployments(
            requests, deps, block_tokens=k.block_tokens, sla=sla, prewarm_s=k.prewarm_s,
            warmup_s=k.warmup_s,
        )  # fmt: skip
        for name, d in result["deployments"].items():
            d["bcr"] = round(d["goodput_rps"] / d["cost"] / reference, 4) if reference else 0.0
            keep = {f: d[f] for f in ("cost", "bcr", "mean_hit", *ROW_KEYS)}
            rows.append({"deployment": name, "hit": hit, **keep})
    return {
        "rate_rps": k.rate_rps, "wan_gbps": k.wan_gbps, "md_chunk_tokens": md_chunk_tokens,
        "slo": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s}, "reference_goodput_per_cost": reference,
        "rows": rows, "valley": valley(rows), "bounded_lead": bounded_lead(rows, "hit", key="bcr"),
    }  # fmt: skip


def _traffic(workload: Workload, k: PaperKnobs, bins: tuple[HitBin, ...] | None) -> tuple[TraceRequest, ...]:
    config = GeneratorConfig(
        rate_rps=k.rate_rps, duration_s=k.prewarm_s + k.duration_s, seed=k.seed,
        block_tokens=k.block_tokens, hit_bins=bins,
    )  # fmt: skip
    return tuple(generate(workload, config))


def _reference_efficiency(workload: Workload, k: PaperKnobs, intra: Deployment, sla: Sla) -> float:
    """Intra-DC PD's goodput per cost on the workload's own (published) hits: BCR's 1."""
    result, _ = run_deployments(
        _traffic(workload, k, None), [intra], block_tokens=k.block_tokens, sla=sla,
        prewarm_s=k.prewarm_s, warmup_s=k.warmup_s,
    )  # fmt: skip
    d = result["deployments"][intra.name]
    return round(float(d["goodput_rps"]) / float(d["cost"]), 6)


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
