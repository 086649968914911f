"""``pddlink sim fallbacks``, ``sim generate`` and ``sim demo-overload``: the lifecycle table, trace
files for ``pddlink demo``, and the simulator's prediction of the demo's wan-overload run (registered
on the ``pddlink sim`` group by ``pddlink.cli.sim``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import click

from pddlink.cli.sim_options import log, workload_opt
from pddlink.sim.fallbacks import FAULTS, fallback_table
from pddlink.sim.generate import GeneratorConfig, generate_trace
from pddlink.sim.records import Sla
from pddlink.sim.trace import scale_trace, write_trace
from pddlink.sim.workload import load_workload


@click.command("fallbacks")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="Output tokens per request.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def fallbacks_cmd(max_tokens: int, as_json: bool) -> None:
    """Each pipeline under each fault, as the router's lifecycle machine decides it (the same
    ``RequestRun`` the router runs, driven in memory): outcome, fallbacks and tokens by decoder."""
    if max_tokens < 1:
        raise click.BadParameter("must be at least 1", param_hint="--max-tokens")
    table = fallback_table(max_tokens)
    if as_json:
        print(json.dumps(table, indent=2))
        return
    print(f"{'pipeline':<12}{'fault':<26}{'outcome':<10}{'fallbacks / reason':<40}tokens")
    for pipeline, row in table.items():
        for fault in FAULTS:
            cell = row[fault]
            why = ",".join(cell["fallbacks"]) or cell["reason"] or "-"
            tokens = " ".join(f"{src}:{n}" for src, n in cell["tokens"].items())
            print(f"{pipeline:<12}{fault:<26}{cell['outcome']:<10}{why:<40}{tokens}")


@click.command("generate")
@workload_opt
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--requests", "count", type=int, default=200, show_default=True)
@click.option("--rate", type=float, default=80.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--uniform", is_flag=True, help="The uniform 85-95%% hit contrast case.")
@click.option(
    "--conversation", is_flag=True,
    help="Chat sessions whose every turn re-sends the conversation so far (``sim.conversation``).",
)  # fmt: skip
@click.option("--block-tokens", type=int, help="Scale: tokens per block in the written trace.")
@click.option("--context-tokens", type=int, help="Scale: median prompt length in the written trace.")
@click.option("--max-output-tokens", type=int, help="Scale: cap output lengths and bounds.")
@click.option("--time-scale", type=float, default=1.0, show_default=True, help="Stretch arrival times.")
def generate_cmd(
    workload_path: Path, out: Path, count: int, rate: float, seed: int, uniform: bool, conversation: bool,
    block_tokens: int | None, context_tokens: int | None, max_output_tokens: int | None, time_scale: float,
) -> None:  # fmt: skip
    """Write an agentic (or ``--conversation``) trace (JSONL) from the workload file, optionally
    scaled for one machine."""
    from pddlink.cli.preflight import check_output_file
    from pddlink.sim.conversation import ConversationConfig, conversation_trace

    check_output_file(str(out), "sim generate --out")
    workload = load_workload(workload_path)
    if conversation:
        trace = conversation_trace(workload, ConversationConfig(rate_rps=rate, requests=count, seed=seed))
    else:
        trace = generate_trace(
            workload, GeneratorConfig(rate_rps=rate, requests=count, seed=seed, uniform_hits=uniform)
        )
    trace = scale_trace(
        trace, block_tokens=block_tokens, context_tokens=context_tokens, max_output_tokens=max_output_tokens,
        time_scale=time_scale,
    )  # fmt: skip
    write_trace(out, trace)
    log(f"wrote {len(trace.requests)} requests to {out} (block {trace.meta.block_tokens} tokens)")


@click.command("demo-overload")
@workload_opt
@click.option(
    "--trace", "trace_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Replay this trace as `pddlink demo --trace` does (default: agentic traffic at the demo's scale).",
)  # fmt: skip
@click.option("--requests", "count", type=int, default=200, show_default=True, help="Measured requests.")
@click.option("--warmup", type=int, default=16, show_default=True, help="Requests before them (caches).")
@click.option("--rate", type=float, default=4.0, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True), default=2000.0, show_default=True)
@click.option("--slo-tpot-ms", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True)
@click.option(
    "--slowdown", type=click.FloatRange(min=0.05, max=100.0), default=1.0, show_default=True,
    help="The tiny engine's step time this many times what the simulator was calibrated at (a run's "
    "baseline TPOT P50 over the calibrated one's, ~3 ms; below 1: a faster engine).",
)  # fmt: skip
@click.option(
    "--md-prefill-slowdown", type=click.FloatRange(1.0, 100.0), default=1.0, show_default=True,
    help="MD's chips prefill this many times slower than P's (`pddlink demo --md-prefill-slowdown`).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
def demo_overload_cmd(
    workload_path: Path, trace_path: Path | None, count: int, warmup: int, rate: float, seed: int,
    slo_ttft_ms: float, slo_tpot_ms: float, slowdown: float, md_prefill_slowdown: float, as_json: bool,
) -> None:  # fmt: skip
    """Predict `pddlink demo --scenario wan-overload`: the baseline, PDD bounded and PDD unbounded on
    the demo's requests and line (``sim.demo_overload``), ranked by goodput (the demo's SLO defaults)."""
    from pddlink.sim.demo_overload import OVERLOAD_KNOBS, demo_line_mbit, predict
    from pddlink.sim.demo_scale import replay_trace

    trace = replay_trace(
        requests=count + warmup, rate_rps=rate, seed=seed, workload=load_workload(workload_path),
        trace_file=trace_path,
    )  # fmt: skip
    md_chips = replace(OVERLOAD_KNOBS, md_prefill_slowdown=md_prefill_slowdown)
    sla, knobs = Sla(slo_ttft_ms / 1e3, slo_tpot_ms / 1e3), md_chips.slowed(slowdown)
    result = predict(trace, warmup, demo_line_mbit(trace, warmup), sla, knobs)
    result["slowdown"], result["md_prefill_slowdown"] = slowdown, md_prefill_slowdown
    result["source"] = str(trace_path) if trace_path else f"agentic seed={seed}"
    if as_json:
        click.echo(json.dumps(result))
        return
    for name, f in result["policies"].items():
        click.echo(
            f"{name:>10}: goodput {f['goodput_rps']:.2f} req/s, TTFT P90 {f['ttft_p90_s']:.2f} s, "
            f"{f['tokens_per_s_per_request']:.0f} tok/s per request, {f['rejected']} refused"
        )
    click.echo("ranking: " + " > ".join(" = ".join(g) for g in result["ranking"]))
    click.echo(f"line {result['line_mbit']} Mbit/s; SLO TTFT {slo_ttft_ms:g} ms, TPOT {slo_tpot_ms:g} ms")
