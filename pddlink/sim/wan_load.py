"""When the WAN is the bottleneck: the paper deployments on a line too thin for the missing suffixes.

The offered WAN load is the rate at which the missing suffixes' KV would have to cross the line
(bytes per second of what the decode side's caches lack, as cross-datacenter PD ships it), over the
line's goodput. ``offered_suffix_bytes_s`` measures it on the traffic itself (one cross-datacenter
PD run on a line so fat it never queues); ``wan_load_deployments`` then sizes the line so the same
traffic offers ``load`` times what it carries, and runs cross-datacenter PD (P->MD), PDD without
recompute, PDD with recompute (MD prefills the missing suffix itself at its own, decode-leaning
speed, whenever that is sooner) and PDD with the bounded policy (recompute only where the TPOT of
MD's running requests and of the request itself stays within the SLO's bound), all with
admission: a request's deadline is the SLA (TTFT bound plus the TPOT bound per output token), and
what no option can end by then (or, bounded, end within the TPOT bound) is rejected at arrival,
counted apart. Both recompute variants run MD as an engine with chunked prefill of a fixed
per-step budget (``md_chunk_tokens``, 2048 by default: vLLM's and SGLang's usual setting), which
knows nothing of the TPOT bound: what protects the running requests is the policy or nothing.

``run_wan_load_sweep`` gives one row per (deployment, load); ``wan_overload_scenario`` is the
public overload scenario (load 2 by default, at least 1.8 as the issue asks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pddlink.errors import ConfigError
from pddlink.sim.deploy import Deployment, Kind, Link
from pddlink.sim.engine import Simulation
from pddlink.sim.generate import GeneratorConfig, generate
from pddlink.sim.records import Sla
from pddlink.sim.scenario import PaperKnobs, paper_deployments, run_deployments, sla_of
from pddlink.sim.trace import TraceRequest
from pddlink.sim.workload import Workload

MD_CHUNK_TOKENS = 256  # MD's chunked-prefill budget per step, when it recomputes
FAT_LINE_GBPS = 10_000.0  # never queues: what crosses is what the caches lack, not what the line allows


@dataclass(frozen=True, slots=True)
class WanLoadKnobs:
    paper: PaperKnobs = field(default_factory=lambda: PaperKnobs(duration_s=900.0))
    load: float = 2.0  # offered suffix bytes / line goodput
    md_chunk_tokens: int = MD_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.load <= 0:
            raise ConfigError(f"load must be > 0, got {self.load}")
        if self.md_chunk_tokens < 1:
            raise ConfigError(f"md_chunk_tokens must be >= 1, got {self.md_chunk_tokens}")


def traffic(workload: Workload, k: PaperKnobs) -> tuple[TraceRequest, ...]:
    config = GeneratorConfig(
        rate_rps=k.rate_rps, duration_s=k.prewarm_s + k.duration_s, seed=k.seed, block_tokens=k.block_tokens
    )
    return tuple(generate(workload, config))


def offered_suffix_bytes_s(workload: Workload, k: PaperKnobs, requests: Sequence[TraceRequest]) -> float:
    """Bytes per second of missing suffixes over the measured window, as cross-DC PD ships them."""
    fat = Link(wan_gbps=FAT_LINE_GBPS, pool_size=k.pool_size, flow_cap_gbps=FAT_LINE_GBPS)
    cross = next(d for d in paper_deployments(workload, k, link=fat) if d.kind is Kind.CROSS_DC_PD)
    records = Simulation(cross, k.block_tokens).run(requests, warmup_s=k.warmup_s, prewarm_s=k.prewarm_s)
    arrived = [r for r in records.records if r.measured]
    return sum(r.missing_tokens for r in arrived) * cross.kv_bytes_per_token / records.measured_s


def wan_load_deployments(
    workload: Workload,
    k: PaperKnobs,
    load: float,
    suffix_bytes_s: float,
    sla: Sla | None = None,
    md_chunk_tokens: int = MD_CHUNK_TOKENS,
) -> list[Deployment]:
    """P->MD, PDD, PDD with recompute and PDD bounded, on a line that carries ``1 / load`` of the
    suffixes; admission and the bounded policy use ``sla`` (default: the workload's)."""
    eff = Link().wan_efficiency
    gbps = suffix_bytes_s * 8 / 1e9 / eff / load
    link = Link(wan_gbps=gbps, pool_size=k.pool_size, flow_cap_gbps=min(k.flow_cap_gbps, gbps))
    return policy_variants(
        paper_deployments(workload, k, link=link), sla or sla_of(workload), md_chunk_tokens
    )


def policy_variants(
    paper: Sequence[Deployment], sla: Sla, md_chunk_tokens: int = MD_CHUNK_TOKENS, keep_intra: bool = False
) -> list[Deployment]:
    """The four policies compared on goodput, from ``paper_deployments``: P->MD (cross-DC PD), PDD
    without recompute, PDD with recompute and PDD bounded, all with admission against ``sla``; MD
    recomputes with chunked prefill of ``md_chunk_tokens``. ``keep_intra``: intra-DC PD first, as is
    (no WAN, no admission: the BCR normaliser)."""
    admission = dict(deadline_s=sla.ttft_s, deadline_per_token_s=sla.tpot_s, ttft_deadline_s=sla.ttft_s)
    intra = [d for d in paper if d.kind is Kind.INTRA_DC_PD][:1] if keep_intra else []
    out = [replace(d, **admission) for d in paper if d.kind is not Kind.INTRA_DC_PD]  # type: ignore[arg-type]
    pdd = out[-1]
    recompute = replace(
        pdd, name="pdd_recompute", policy=replace(pdd.policy, recompute_enabled=True),
        md_chunk_tokens=md_chunk_tokens,
    )  # fmt: skip
    return [*intra, *out, recompute, replace(recompute, name="pdd_bounded", tpot_bound_s=sla.tpot_s)]


ROW_KEYS = (
    "ttft_s", "tpot_s", "goodput_rps", "tokens_per_s_per_request", "rld_token_share", "rejected_share",
    "rejected", "decisions",
)  # fmt: skip


def run_wan_load_sweep(
    workload: Workload,
    k: PaperKnobs,
    loads: Sequence[float],
    progress: Callable[[str], None] | None = None,
    sla: Sla | None = None,
    md_chunk_tokens: int = MD_CHUNK_TOKENS,
) -> dict[str, Any]:
    """One row per (deployment, load): TTFT and TPOT percentiles, SLA goodput, output speed per
    request, RLD's token share, rejected."""
    sla = sla or sla_of(workload)
    requests = traffic(workload, k)
    suffix = offered_suffix_bytes_s(workload, k, requests)
    rows = []
    for load in loads:
        if load <= 0:
            raise ConfigError(f"WAN loads must be > 0, got {load}")
        if progress:
            progress(f"WAN load {load:g}x")
        deps = wan_load_deployments(workload, k, load, suffix, sla, md_chunk_tokens)
        result, _ = run_deployments(
            requests, deps, block_tokens=k.block_tokens, sla=sla, prewarm_s=k.prewarm_s,
            warmup_s=k.warmup_s,
        )  # fmt: skip
        for name, d in result["deployments"].items():
            rows.append({"deployment": name, "wan_load": load, **{f: d[f] for f in ROW_KEYS}})
    line_gbps = suffix * 8 / 1e9 / Link().wan_efficiency
    return {
        "offered_suffix_gbps": round(line_gbps, 4), "rate_rps": k.rate_rps,
        "md_chunk_tokens": md_chunk_tokens, "slo": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s},
        "rows": rows,
    }  # fmt: skip


def wan_overload_scenario(
    workload: Workload,
    knobs: WanLoadKnobs,
    progress: Callable[[str], None] | None = None,
    sla: Sla | None = None,
) -> dict[str, Any]:
    """The four policies at ``knobs.load`` times the line; ``run_deployments``' document."""
    k = knobs.paper
    sla = sla or sla_of(workload)
    requests = traffic(workload, k)
    suffix = offered_suffix_bytes_s(workload, k, requests)
    deps = wan_load_deployments(workload, k, knobs.load, suffix, sla, knobs.md_chunk_tokens)
    result, _ = run_deployments(
        requests, deps, block_tokens=k.block_tokens, sla=sla, prewarm_s=k.prewarm_s,
        warmup_s=k.warmup_s, progress=progress,
    )  # fmt: skip
    result["slo"] = {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s}
    result["wan_load"] = knobs.load
    result["line_gbps"] = round(deps[0].link.wan_gbps, 4)
    return result
