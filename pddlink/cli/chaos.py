"""``pddlink chaos``: the fault suite (see ``harness.chaos``)."""

from __future__ import annotations

from pathlib import Path

import click

# per engine: what the reference engine's processes carry, and what vLLM servers on 2 cores do
DEFAULTS: dict[str, dict[str, float]] = {
    "reference": {"requests": 1000, "concurrency": 50, "deadline_s": 10.0, "max_output": 48,
                  "line_mbit": 100.0, "rtt_ms": 20.0},
    "vllm": {"requests": 240, "concurrency": 4, "deadline_s": 20.0, "max_output": 16,
             "line_mbit": 50.0, "rtt_ms": 10.0},
    # --topology: a sidecar per instance (8 in the example) and two WAN relays on a small machine
    "pools": {"requests": 360, "concurrency": 32, "deadline_s": 15.0, "max_output": 32,
              "line_mbit": 0.0, "rtt_ms": 0.0},
}  # fmt: skip


@click.command(name="chaos")
@click.option(
    "--engine",
    type=click.Choice(["reference", "vllm"]),
    default="reference",
    show_default=True,
    help='The engines in the roles: pddlink\'s reference engine, or vLLM servers (engine = "vllm").',
)
@click.option("--requests", type=int, help="Requests in the load [reference 1000, vllm 240].")
@click.option("--concurrency", type=int, help="Requests in flight at once [reference 50, vllm 4].")
@click.option("--deadline-s", type=float, help="Every request's deadline [reference 10, vllm 20].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON here.")
@click.option("--plot", "plot_path", help="Timeline PNG [next to --json FILE, else out/pddlink-chaos.png].")
@click.option("--seed", default=1, show_default=True, help="Workload seed.")
@click.option("--line-mbit", type=float, help="WAN line rate [reference 100, vllm 50].")
@click.option("--rtt-ms", type=float, help="WAN round-trip time [reference 20, vllm 10].")
@click.option("--max-output", type=int, help="Longest output, tokens [reference 48, vllm 16].")
@click.option(
    "--engine-mode",
    type=click.Choice(["thread", "process"]),
    default="process",
    show_default=True,
    help="Each sidecar's engine: a child process (its kill is a fault of the schedule) or a thread.",
)
@click.option(
    "--topology",
    "topology",
    type=click.Path(exists=True, dir_okay=False),
    help="Run on a topology's pools (reference engine; the links' rates and RTTs are the file's): "
    "kill -9 of one MD of two and of one P of two, a drain during the load [360 requests, 32 at "
    "once, deadline 15 s, max output 32].",
)
def command(
    engine: str,
    requests: int | None,
    concurrency: int | None,
    deadline_s: float | None,
    json_path: str | None,
    plot_path: str | None,
    seed: int,
    line_mbit: float | None,
    rtt_ms: float | None,
    max_output: int | None,
    engine_mode: str,
    topology: str | None,
) -> None:
    """Bring up P, RLD, MD and the router across an emulated WAN, drive a bounded streaming load
    (mixed pipelines, greedy and seeded), and run the fault schedule meanwhile: kill -9 and restart
    of MD, RelayDecode, P and MD's engine process, WAN outages shorter and longer than the deadline,
    a one-way cut, corrupted packets on the WAN, a burst of 4x the concurrency. Then
    check the invariants (no hung request, exact tokens, no gaps or duplicates, typed failures,
    nothing held 10 s after, flat RSS) and print a table, a JSON report and a PNG timeline.

    With --engine vllm: P, RelayDecode and MD are vLLM servers beside their sidecars (float32 greedy,
    exact against P's vLLM alone), the schedule is kill -9 and restart of each vLLM server and two
    WAN outages, scaled to a small machine; after each restart the table shows what that server's
    sidecar held (0 of everything: it reset what it held for the dead engine)."""
    from pddlink.cli.preflight import check_output_file, check_writable

    if topology is not None and engine != "reference":
        raise click.BadParameter("--topology runs the reference engine's pools only", param_hint="--topology")
    d = DEFAULTS["pools" if topology is not None else engine]
    requests = int(d["requests"] if requests is None else requests)
    concurrency = int(d["concurrency"] if concurrency is None else concurrency)
    deadline_s = float(d["deadline_s"] if deadline_s is None else deadline_s)
    max_output = int(d["max_output"] if max_output is None else max_output)
    line_mbit = float(d["line_mbit"] if line_mbit is None else line_mbit)
    rtt_ms = float(d["rtt_ms"] if rtt_ms is None else rtt_ms)
    if requests < 1 or concurrency < 1 or deadline_s <= 0 or max_output < 1:
        raise click.BadParameter("--requests, --concurrency, --max-output >= 1 and --deadline-s > 0")
    if plot_path is None:
        plot_path = str(
            Path(json_path).with_suffix(".png") if json_path else Path("out") / "pddlink-chaos.png"
        )
    check_output_file(json_path, "chaos --json")
    check_output_file(plot_path, "chaos --plot")
    import tempfile

    check_writable(tempfile.gettempdir(), "chaos run directory (TMPDIR)")
    if engine == "vllm":
        from harness.chaos.vllm_run import VllmChaosSpec
        from harness.chaos.vllm_run import main as vllm_main

        spec = VllmChaosSpec(
            requests=requests,
            concurrency=concurrency,
            deadline_s=deadline_s,
            max_output=max_output,
            seed=seed,
            line_mbit=line_mbit,
            rtt_ms=rtt_ms,
        )
        vllm_main(spec, json_path, plot_path)
        return
    if topology is not None:
        from harness.chaos.pools import main as pools_main

        pools_main(
            topology_path=topology,
            requests=requests,
            concurrency=concurrency,
            deadline_s=deadline_s,
            json_path=json_path,
            plot_path=plot_path,
            seed=seed,
            max_output=max_output,
        )
        return
    from harness.chaos.run import main

    main(
        requests=requests,
        concurrency=concurrency,
        deadline_s=deadline_s,
        json_path=json_path,
        plot_path=plot_path,
        seed=seed,
        line_mbit=line_mbit,
        rtt_ms=rtt_ms,
        max_output=max_output,
        engine_mode=engine_mode,
    )
