"""``pddlink chaos``: the fault suite (see ``harness.chaos``)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command(name="chaos")
@click.option("--requests", default=1000, show_default=True, help="Requests in the load.")
@click.option("--concurrency", default=50, show_default=True, help="Requests in flight at once.")
@click.option("--deadline-s", default=10.0, show_default=True, help="Every request's deadline.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the report as JSON here.")
@click.option("--plot", "plot_path", help="Timeline PNG [next to --json FILE, else out/pddlink-chaos.png].")
@click.option("--seed", default=1, show_default=True, help="Workload seed.")
@click.option("--line-mbit", default=100.0, show_default=True, help="WAN line rate.")
@click.option("--rtt-ms", default=20.0, show_default=True, help="WAN round-trip time.")
@click.option("--max-output", default=48, show_default=True, help="Longest output, tokens.")
@click.option(
    "--engine-mode",
    type=click.Choice(["thread", "process"]),
    default="process",
    show_default=True,
    help="Each sidecar's engine: a child process (its kill is a fault of the schedule) or a thread.",
)
def command(
    requests: int,
    concurrency: int,
    deadline_s: float,
    json_path: str | None,
    plot_path: str | None,
    seed: int,
    line_mbit: float,
    rtt_ms: float,
    max_output: int,
    engine_mode: str,
) -> None:
    """Bring up P, RLD, MD and the router across an emulated WAN, drive a bounded streaming load
    (mixed pipelines, greedy and seeded), and run the fault schedule meanwhile: kill -9 and restart
    of MD, RelayDecode, P and MD's engine process, WAN outages shorter and longer than the deadline,
    a one-way cut, corrupted packets on the WAN, a burst of 4x the concurrency. Then
    check the invariants (no hung request, exact tokens, no gaps or duplicates, typed failures,
    nothing held 10 s after, flat RSS) and print a table, a JSON report and a PNG timeline."""
    from harness.chaos.run import main
    from pddlink.cli.preflight import check_output_file, check_writable

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
