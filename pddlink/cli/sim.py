"""``pddlink sim``: the cluster simulator from the command line.

``pddlink sim --scenario paper [--json]`` runs the calibrated comparison (``--scenario wan-overload``:
the same traffic on a line that carries half of the missing suffixes); ``--trace FILE`` replays a
pddlink or Mooncake trace through the same deployments; ``--topology FILE [--placement POLICY]``
replays the demo's traffic over a topology's pools under each placement policy (``sim.pools``).
``pddlink sim skew`` compares KV-transfer latency on the line for skewed vs uniform hits;
``pddlink sim sweep`` varies line rate, RLD count, hit skew, or compares the goodput of P->MD, PDD,
PDD with recompute and PDD with the TPOT-bounded policy against the offered WAN load
(``--wan-load``) or the mean prefix hit rate (``--bathtub``); ``pddlink sim generate`` writes a
trace for ``pddlink demo`` (``--conversation``: chat sessions); ``pddlink sim demo-overload`` predicts
``pddlink demo --scenario wan-overload`` (the three policies' goodput ranking on its requests).
Goodput is requests per second meeting both SLOs: ``--slo-ttft-ms`` (default the workload's TTFT
bound, 30 s; ``demo-overload``: the demo's, 2 s) and ``--slo-tpot-ms`` (default the workload's TPOT
SLO, 30 ms; ``demo-overload``: 10 ms), on ``pddlink sim`` and on ``sweep``. Progress goes to
stderr; ``--json`` prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from pddlink.cli.sim_options import log as _log
from pddlink.cli.sim_options import slo_options as _slo_options
from pddlink.cli.sim_options import workload_opt as _workload_opt
from pddlink.cli.sim_sweeps import CHECK_TOLERANCE
from pddlink.cli.sim_traces import demo_overload_cmd, fallbacks_cmd, generate_cmd
from pddlink.errors import InvalidInput
from pddlink.routing import PlacementPolicy
from pddlink.sim.engine import Simulation
from pddlink.sim.fallbacks import fallback_table
from pddlink.sim.generate import GeneratorConfig, generate
from pddlink.sim.goodput import GeneratedTraffic, sustained_goodputs
from pddlink.sim.records import Sla
from pddlink.sim.scenario import (
    FITTED,
    PaperKnobs,
    line_test_deployments,
    paper_deployments,
    pdd_variants,
    rate_search,
    run_deployments,
    run_skew,
    run_sweep,
    skew_across_seeds,
    sla_of,
    use_sustained_goodput,
)
from pddlink.sim.trace import read_trace
from pddlink.sim.wan_load import MD_CHUNK_TOKENS
from pddlink.sim.workload import Workload, load_workload


def _sla(workload: Workload, ttft_ms: float | None, tpot_ms: float | None) -> Sla:
    base = sla_of(workload)
    return Sla(
        ttft_s=base.ttft_s if ttft_ms is None else ttft_ms / 1000,
        tpot_s=base.tpot_s if tpot_ms is None else tpot_ms / 1000,
    )


# The 80 req/s line tests (skew, bench) measure from 30 s after the prewarm, as before the paper
# scenario moved to the published scale (whose P queues need a longer warm-up: PaperKnobs.warmup_s).
_LINE_TEST_WARMUP_S = 150.0


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result))
        return
    for name, d in result["deployments"].items():
        t = d["ttft_s"]
        click.echo(
            f"{name:>16}: TTFT p50 {t['p50']:.2f}s p90 {t['p90']:.2f}s p99 {t['p99']:.2f}s  "
            f"goodput {d['goodput_rps']:.1f} rps  cost {d['cost']:.1f}  BCR {d['bcr']:.3f}"
        )
    click.echo(f"RLD token share {result['rld_token_share']:.1%}, simulated {result['simulated_s']:.0f}s, "
               f"wall {result['wall_s']:.1f}s")  # fmt: skip


@click.group(invoke_without_command=True)
@click.option(
    "--scenario", type=click.Choice(["paper", "demo", "wan-overload"]),
    help="paper: the calibrated datacenter comparison; demo: the scaled-down deployment of `pddlink demo`; "
    "wan-overload: the paper traffic on a line carrying half of the missing suffixes (with admission).",
)  # fmt: skip
@click.option(
    "--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), help="Replay a trace file."
)
@_workload_opt
@click.option(
    "--topology",
    "topology_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Simulate this topology (TOML [topology]) at the demo's scale, per placement policy.",
)
@click.option(
    "--placement",
    type=click.Choice(["all", *(p.value for p in PlacementPolicy)]),
    default="all",
    show_default=True,
    help="--topology: the placement policy to run (the oracle always runs too).",
)
@click.option(
    "--rld-token-budget",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=None,
    help="--topology: the router's RLD token budget (1: none; default: the pools demo's, 0.25).",
)
@click.option("--rate", type=float, help="Offered load in requests/s (paper scenario).")
@click.option("--duration", type=float, help="Simulated seconds of traffic (paper scenario).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--variants", is_flag=True, help="Also run PDD one-shot, catch-up and without the singular filter."
)
@click.option(
    "--plots", type=click.Path(file_okay=False, path_type=Path), help="Write PNG plots to this folder."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@_slo_options
@click.pass_context
def group(
    ctx: click.Context,
    scenario: str | None,
    trace_path: Path | None,
    topology_path: Path | None,
    placement: str,
    rld_token_budget: float | None,
    workload_path: Path,
    rate: float | None,
    duration: float | None,
    seed: int,
    variants: bool,
    plots: Path | None,
    as_json: bool,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> None:
    """Cluster simulator: TTFT, goodput and benefit-cost ratio at datacenter scale."""
    ctx.obj = {"slo_ms": (slo_ttft_ms, slo_tpot_ms)}  # the default of ``sweep``'s own flags
    if ctx.invoked_subcommand is not None:
        return
    if sum(x is not None for x in (scenario, trace_path, topology_path)) != 1:
        raise click.UsageError("give exactly one of --scenario paper|demo, --trace FILE and --topology FILE")
    started = time.perf_counter()
    workload = load_workload(workload_path)
    if topology_path is not None:
        _run_topology(topology_path, placement, workload, seed, rate, as_json, rld_token_budget)
        return
    sla = _sla(workload, slo_ttft_ms, slo_tpot_ms)
    if scenario == "demo":
        _emit(_run_demo_scale(workload, seed, rate, started, sla), as_json)
        return
    if scenario == "wan-overload":
        _emit(_run_wan_overload(workload, seed, rate, duration, started, sla), as_json)
        return
    knobs = PaperKnobs(seed=seed)
    if rate is not None:
        knobs = replace(knobs, rate_rps=rate)
    if duration is not None:
        knobs = replace(knobs, duration_s=duration)
    deployments = paper_deployments(workload, knobs)
    if variants:
        deployments += pdd_variants(deployments[-1])
    if trace_path is not None:
        trace = read_trace(trace_path)
        requests, block, prewarm, warmup = trace.requests, trace.meta.block_tokens, 0.0, 0.0
        source = str(trace_path)
    else:
        _log(f"generating {knobs.rate_rps} req/s for {knobs.prewarm_s + knobs.duration_s:.0f}s ...")
        config = GeneratorConfig(
            rate_rps=knobs.rate_rps, duration_s=knobs.prewarm_s + knobs.duration_s, seed=knobs.seed,
            block_tokens=knobs.block_tokens,
        )  # fmt: skip
        requests = tuple(generate(workload, config))
        block, prewarm, warmup, source = knobs.block_tokens, knobs.prewarm_s, knobs.warmup_s, "paper"
    searches = None
    if trace_path is None:
        search = rate_search(knobs)
        traffic = GeneratedTraffic(workload, knobs.seed, knobs.block_tokens, search.duration_s)
        workers = min(len(deployments), max(1, (os.cpu_count() or 1)))
        _log(f"searching each deployment's sustained SLA rate ({workers} worker processes) ...")
        searches = sustained_goodputs(deployments, traffic, sla, search, workers)
    result, runs = run_deployments(
        requests, deployments, block_tokens=block, sla=sla, prewarm_s=prewarm, warmup_s=warmup,
        progress=lambda name: _log(f"simulating {name} ({len(requests)} requests) ..."),
    )  # fmt: skip
    if searches is not None:
        use_sustained_goodput(
            result, {d.name: f.result() for d, f in zip(deployments, searches, strict=True)}
        )
    result["wall_s"] = round(time.perf_counter() - started, 2)
    result["scenario"] = {"source": source, "knobs": _knobs_dict(knobs) if trace_path is None else None}
    result["fitted"] = FITTED
    result["slo"] = {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s}
    result["published"] = workload.published.get("ttft_s", {})
    result["fallbacks"] = fallback_table()  # what the router's machine does under each fault
    if plots is not None:
        from pddlink.sim.plots import plot_ttft_cdfs

        result["plots"] = [str(plot_ttft_cdfs(runs, plots / "ttft_cdf.png"))]
    _emit(result, as_json)


@group.command("skew")
@_workload_opt
@click.option("--rate", type=float, default=80.0, show_default=True)
@click.option("--duration", type=float, default=300.0, show_default=True)
@click.option("--wan-gbps", type=float, default=20.0, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--seeds", type=click.IntRange(1, 20), default=3, show_default=True,
    help="Run seeds SEED..SEED+SEEDS-1; the first one's figures in full, all of them in across_seeds.",
)  # fmt: skip
@click.option(
    "--fifo-pool", is_flag=True, help="One transfer per connection, waiting FIFO (default: multiplexed)."
)
@click.option(
    "--plots", type=click.Path(file_okay=False, path_type=Path), help="Write the KV-transfer CDF plot here."
)
@click.option("--json", "as_json", is_flag=True)
def skew_cmd(
    workload_path: Path,
    rate: float,
    duration: float,
    wan_gbps: float,
    seed: int,
    seeds: int,
    fifo_pool: bool,
    plots: Path | None,
    as_json: bool,
) -> None:
    """KV transfer latency on the line: skewed vs uniform prefix hits with the same mean."""
    started = time.perf_counter()
    workload = load_workload(workload_path)
    by_seed: dict[int, dict[str, Any]] = {}
    runs: dict[str, Any] = {}
    for s in range(seed, seed + seeds):
        knobs = replace(
            PaperKnobs(seed=s), rate_rps=rate, duration_s=duration, wan_gbps=wan_gbps,
            warmup_s=_LINE_TEST_WARMUP_S,
        )  # fmt: skip
        _log(f"seed {s}:")
        by_seed[s], seed_runs = run_skew(
            workload, knobs, progress=lambda n: _log(f"simulating {n} hits ..."), fifo_pool=fifo_pool
        )
        runs = runs or seed_runs
    result = {**by_seed[seed], "seed": seed, "across_seeds": skew_across_seeds(by_seed)}
    result["wall_s"] = round(time.perf_counter() - started, 2)
    result["published"] = workload.published.get("wan_20gbps_80rps_90pct_hit", {})
    if plots is not None:
        from pddlink.sim.plots import plot_kv_transfer

        samples = {name: rec.kv_transfer() for name, rec in runs.items()}
        result["plots"] = [str(plot_kv_transfer(samples, plots / "kv_transfer_skew.png"))]
    if as_json:
        click.echo(json.dumps(result))
        return
    for name in ("skewed", "uniform"):
        r = result[name]
        kv = r["kv_transfer_s"]
        click.echo(
            f"{name:>8}: KV transfer p50 {kv['p50']}s p99 {kv['p99']}s, pool full "
            f"{r['pool_full_share']:.0%} (connections busy {r['pool_utilisation']:.0%}), "
            f"line {r['wan_utilisation']:.0%}"
        )
    across = result["across_seeds"]
    click.echo(
        f"uniform/skewed P50: {result['p50_ratio']}x (published ~5x), P99: {result['p99_ratio']}x "
        f"(published 1.35x); over seeds {across['seeds']}: P50 {across['p50_ratio']}x, "
        f"P99 {across['p99_ratio']}x"
    )


@group.command("bench")
@_workload_opt
@click.option("--rate", type=float, default=80.0, show_default=True)
@click.option("--duration", type=float, default=3600.0, show_default=True)
@click.option("--deployment", type=click.Choice(["intra_dc_pd", "cross_dc_pd", "pdd"]), default="pdd")
@click.option("--wan-gbps", type=float, default=20.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_cmd(
    workload_path: Path, rate: float, duration: float, deployment: str, wan_gbps: float, as_json: bool
) -> None:
    """Simulator speed: one deployment, ``duration`` seconds of traffic generated on the fly (the
    paper layout at the line-test speeds, which carry 80 req/s: ``scenario.LINE_TEST_FIGURES``)."""
    workload = load_workload(workload_path)
    knobs = replace(PaperKnobs(), rate_rps=rate, wan_gbps=wan_gbps, warmup_s=_LINE_TEST_WARMUP_S)
    dep = next(d for d in line_test_deployments(workload, knobs) if d.name == deployment)
    config = GeneratorConfig(
        rate_rps=rate, duration_s=duration, seed=knobs.seed, block_tokens=knobs.block_tokens
    )
    started = time.perf_counter()
    records = Simulation(dep, knobs.block_tokens).run(
        generate(workload, config), warmup_s=knobs.warmup_s, prewarm_s=knobs.prewarm_s
    )
    wall = time.perf_counter() - started
    summary = records.summary(sla_of(workload), dep.link.wan_bytes_s)
    result = {
        "deployment": deployment, "rate_rps": rate, "wan_gbps": wan_gbps,
        "simulated_s": round(records.simulated_s, 1),
        "requests": len(records.records), "events": records.events, "wall_s": round(wall, 2),
        "us_per_request": round(wall / max(1, len(records.records)) * 1e6, 1),
        "ttft_s": summary["ttft_s"], "unfinished": summary["unfinished"],
    }  # fmt: skip
    click.echo(json.dumps(result) if as_json else f"{result}")


@group.command("sweep")
@_workload_opt
@click.option("--over", type=click.Choice(["line_gbps", "rld_gpus", "skew"]))
@click.option("--values", help="Comma-separated values, e.g. 10,20,40 or 1,3,6 or 0,0.5,1.")
@click.option(
    "--wan-load",
    "wan_load",
    help="Instead of --over/--values: offered WAN loads of the missing suffixes (x the line), e.g. "
    "0.5,1,1.5,2,2.5,3; goodput of P->MD, PDD, PDD with recompute and PDD bounded (TPOT), with "
    "admission. One row per point.",
)
@click.option(
    "--bathtub",
    help="Instead: mean prefix hit rates, e.g. 0.05,0.25,0.5,0.7,0.85,0.95,0.99; benefit per cost "
    "(BCR) of the same policies and intra-DC PD on the paper line. One row per point.",
)
@click.option(
    "--md-chunk-tokens", type=click.IntRange(min=1), default=MD_CHUNK_TOKENS, show_default=True,
    help="--wan-load/--bathtub: MD's chunked-prefill budget per step when it recomputes.",
)  # fmt: skip
@click.option(
    "--check", is_flag=True,
    help="--wan-load: exit 1 unless PDD bounded's goodput is at or above the best of the others at "
    "every load; --bathtub: unless its lowest BCR is at or above the others' lowest; within "
    f"{CHECK_TOLERANCE:.0%}.",
)  # fmt: skip
@click.option(
    "--search-steps", type=click.IntRange(1, 10), default=6, show_default=True,
    help="--bathtub: halvings of the sustained-rate search per deployment and point.",
)  # fmt: skip
@click.option(
    "--plots", type=click.Path(file_okay=False, path_type=Path),
    help="--wan-load/--bathtub: write the PNG here.",
)  # fmt: skip
@click.option("--rate", type=float, default=PaperKnobs().rate_rps, show_default=True)
@click.option("--duration", type=float, default=PaperKnobs().duration_s, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@_slo_options
@click.pass_context
def sweep_cmd(
    ctx: click.Context,
    workload_path: Path,
    over: str | None,
    values: str | None,
    wan_load: str | None,
    bathtub: str | None,
    md_chunk_tokens: int,
    check: bool,
    search_steps: int,
    plots: Path | None,
    rate: float,
    duration: float,
    seed: int,
    as_json: bool,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> None:
    """Sweep line rate, RLD count or hit skew (PDD vs cross- and intra-datacenter PD at each point),
    the offered WAN load (``--wan-load``: where each policy's goodput collapses) or the mean prefix
    hit rate (``--bathtub``: benefit per cost)."""
    started = time.perf_counter()
    given = [x is not None for x in (wan_load, bathtub, over if values is not None else None)]
    if sum(given) != 1 or (over is None) != (values is None):
        raise click.UsageError("give one of --wan-load LOADS, --bathtub HITS, or both --over and --values")
    text, hint = next(
        (t, h) for t, h in ((wan_load, "--wan-load"), (bathtub, "--bathtub"), (values, "--values")) if t
    )
    try:
        points = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"not a list of numbers: {text!r}", param_hint=hint) from None
    if not points or (wan_load is not None and min(points) <= 0):
        raise click.BadParameter("WAN loads must be > 0", param_hint=hint)
    if bathtub is not None and not all(0 <= p <= 1 for p in points):
        raise click.BadParameter("mean hit rates must be in [0, 1]", param_hint=hint)
    workload = load_workload(workload_path)
    knobs = replace(PaperKnobs(seed=seed), rate_rps=rate, duration_s=duration)
    group_ttft, group_tpot = (ctx.obj or {}).get("slo_ms", (None, None))
    sla = _sla(workload, slo_ttft_ms or group_ttft, slo_tpot_ms or group_tpot)
    if wan_load is not None or bathtub is not None:
        from pddlink.cli.sim_sweeps import policy_sweep

        kind = "wan_load" if wan_load is not None else "hit"
        ok = policy_sweep(
            workload, knobs, kind, points, sla, md_chunk_tokens, plots, as_json, started, search_steps
        )
        if check and not ok:
            raise SystemExit(1)
        return
    assert over is not None
    result = run_sweep(workload, knobs, over, points, progress=lambda p: _log(f"simulating {p} ..."))
    result["wall_s"] = round(time.perf_counter() - started, 2)
    if as_json:
        click.echo(json.dumps(result))
        return
    for p in result["points"]:
        x, d = p["cross_dc_pd"]["ttft_s"], p["pdd"]
        click.echo(
            f"{over}={p['value']:g}: PDD TTFT p90 {d['ttft_s']['p90']}s (cross-DC {x['p90']}s), "
            f"BCR {d['bcr']}, RLD share {d['rld_token_share']:.1%}"
        )


def _run_wan_overload(
    workload: Workload, seed: int, rate: float | None, duration: float | None, started: float, sla: Sla
) -> dict[str, Any]:
    from pddlink.sim.wan_load import WanLoadKnobs, wan_overload_scenario

    k = WanLoadKnobs()
    paper = replace(k.paper, seed=seed)
    if rate is not None:
        paper = replace(paper, rate_rps=rate)
    if duration is not None:
        paper = replace(paper, duration_s=duration)
    result = wan_overload_scenario(
        workload, replace(k, paper=paper), progress=lambda n: _log(f"simulating {n} ..."), sla=sla
    )
    result["wall_s"] = round(time.perf_counter() - started, 2)
    result["scenario"] = {"source": "wan-overload", "knobs": _knobs_dict(paper)}
    return result


def _run_demo_scale(
    workload: Workload, seed: int, rate: float | None, started: float, sla: Sla
) -> dict[str, Any]:
    from pddlink.sim.demo_scale import demo_deployments, demo_trace, measured_from_s, single_demo_knobs

    knobs = single_demo_knobs(seed)
    knobs = knobs if rate is None else replace(knobs, rate_rps=rate)
    trace = demo_trace(workload, knobs)
    warm_s = measured_from_s(trace, knobs)
    result, _ = run_deployments(
        trace.requests, demo_deployments(knobs), block_tokens=knobs.block_tokens, sla=sla,
        prewarm_s=warm_s, warmup_s=warm_s,
    )  # fmt: skip
    result["wall_s"] = round(time.perf_counter() - started, 2)
    result["scenario"] = {
        "source": "demo",
        "knobs": {f: getattr(knobs, f) for f in knobs.__dataclass_fields__},
    }
    return result


def _run_topology(
    path: Path,
    placement: str,
    workload: Workload,
    seed: int,
    rate: float | None,
    as_json: bool,
    rld_token_budget: float | None = None,
) -> None:
    from pddlink.sim.demo_scale import POOLS_RLD_TOKEN_BUDGET, DemoKnobs
    from pddlink.sim.pools import run_topology
    from pddlink.topology import load_topology

    try:
        topo = load_topology(path)
    except InvalidInput as e:
        raise click.BadParameter(e.message, param_hint="--topology") from None
    budget = POOLS_RLD_TOKEN_BUDGET if rld_token_budget is None else rld_token_budget
    knobs = DemoKnobs(seed=seed, rld_token_budget=budget)
    if rate is not None:
        knobs = replace(knobs, rate_rps=rate)
    policies = list(PlacementPolicy) if placement == "all" else [PlacementPolicy(placement)]
    try:
        result = run_topology(topo, workload, knobs, policies, progress=_log)
    except InvalidInput as e:
        raise click.BadParameter(e.message, param_hint="--topology") from None
    result["topology"] = str(path)
    if as_json:
        click.echo(json.dumps(result))
        return
    for name, f in result["policies"].items():
        t = f["ttft_s"]
        wan = ", ".join(f"{k} {n / 1e6:.1f} MB" for k, n in f["wan_bytes_by_link"].items())
        click.echo(
            f"{name:>13}: TTFT p50 {t['p50']:.3f}s p90 {t['p90']:.3f}s p99 {t['p99']:.3f}s  "
            f"MD hit {f['md_hit_rate']:.1%}  WAN {wan}  RLD share {f['rld_token_share']:.1%}"
        )
        hits = ", ".join(
            f"{md} {h:.0%} ({f['md_requests_by_instance'][md]})"
            for md, h in f["md_hit_rate_by_instance"].items()
        )
        click.echo(f"{'':>15}per MD: {hits}")
    click.echo(f"oracle MD hit rate {result['oracle_md_hit_rate']:.1%}, wall {result['wall_s']:.1f}s")


def _knobs_dict(knobs: PaperKnobs) -> dict[str, Any]:
    return {f: getattr(knobs, f) for f in knobs.__dataclass_fields__}


group.add_command(fallbacks_cmd)
group.add_command(generate_cmd)
group.add_command(demo_overload_cmd)


def main() -> None:  # pragma: no cover - for `python -m pddlink.cli.sim`
    group(sys.argv[1:])
