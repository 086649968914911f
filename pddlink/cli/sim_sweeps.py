"""``pddlink sim sweep --wan-load`` / ``--bathtub``: the goodput policy sweeps, run and reported.

Runs ``pddlink.sim.wan_load.run_wan_load_sweep`` (goodput against the offered WAN load) or
``pddlink.sim.bathtub.run_bathtub`` (benefit per cost against the mean prefix hit rate), writes
the PNG, prints one JSON object or one line per row, and says (``bounded_at_or_above_best``, within
``CHECK_TOLERANCE``) whether the TPOT-bounded policy's goodput is at or above the best of the others
at every load, or, for the bathtub, whether its valley floor (lowest BCR) is at or above theirs:
what ``--check`` exits on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from pddlink.sim.records import Sla
from pddlink.sim.scenario import PaperKnobs
from pddlink.sim.workload import Workload

CHECK_TOLERANCE = 0.01


def policy_sweep(
    workload: Workload,
    knobs: PaperKnobs,
    over: str,
    points: list[float],
    sla: Sla,
    md_chunk_tokens: int,
    plots: Path | None,
    as_json: bool,
    started: float,
    search_steps: int = 6,
) -> bool:
    """``over``: ``wan_load`` or ``hit``. Returns what ``--check`` exits on: the bounded policy's
    goodput at or above the best of the others at every load, or (``hit``) its lowest BCR at or
    above the best of the others' lowest (the valley's floor)."""
    log = lambda msg: click.echo(f"simulating {msg} ...", err=True)  # noqa: E731
    if over == "wan_load":
        from pddlink.sim.goodput import bounded_lead
        from pddlink.sim.wan_load import run_wan_load_sweep

        result = run_wan_load_sweep(workload, knobs, points, log, sla, md_chunk_tokens)
        result["bounded_lead"] = bounded_lead(result["rows"], "wan_load")
        ok = all(p["lead"] >= -CHECK_TOLERANCE * p["best_other_value"] for p in result["bounded_lead"])
    else:
        from dataclasses import replace

        from pddlink.sim.bathtub import BATHTUB_SEARCH, run_bathtub

        search = replace(BATHTUB_SEARCH, steps=search_steps)
        result = run_bathtub(workload, knobs, points, log, sla, md_chunk_tokens, search)
        floors, lift = result["valley"]["floors"], result["valley"]["floor_lift"]
        best_floor = max((v["bcr"] for n, v in floors.items() if n != "pdd_bounded"), default=0.0)
        ok = lift is not None and lift >= -CHECK_TOLERANCE * best_floor
    result["bounded_at_or_above_best"] = ok
    result["check_tolerance"] = CHECK_TOLERANCE
    result["wall_s"] = round(time.perf_counter() - started, 2)
    if plots is not None:
        from pddlink.sim.plots import plot_bathtub, plot_wan_load

        plot, name = (plot_wan_load, "wan_load.png") if over == "wan_load" else (plot_bathtub, "bathtub.png")
        result["plots"] = [str(plot(result["rows"], plots / name))]
    if as_json:
        click.echo(json.dumps(result))
    else:
        _print(result, over)
    return ok


def _print(result: dict[str, Any], over: str) -> None:
    slo = result["slo"]
    click.echo(f"SLO: TTFT {slo['ttft_s'] * 1000:g} ms, TPOT {slo['tpot_s'] * 1000:g} ms")
    for row in result["rows"]:
        bcr = f", BCR {row['bcr']:.3f}" if "bcr" in row else ""
        click.echo(
            f"{row['deployment']:>14} at {over}={row[over]:g}: goodput {row['goodput_rps']:.2f} rps{bcr}, "
            f"TTFT p90 {row['ttft_s']['p90']}s, TPOT p90 {row['tpot_s']['p90']}s, "
            f"{row['tokens_per_s_per_request']} tok/s per request, rejected {row['rejected_share']:.1%}"
        )
    if "valley" in result:
        click.echo(f"valley floors: {result['valley']['floors']}, lift {result['valley']['floor_lift']}")
    for p in result["bounded_lead"]:
        click.echo(
            f"{over}={p[over]:g}: pdd_bounded {p['bounded']} vs best other {p['best_other']} "
            f"{p['best_other_value']} (lead {p['lead']:+})"
        )
    click.echo(f"bounded at or above the best: {result['bounded_at_or_above_best']}")
