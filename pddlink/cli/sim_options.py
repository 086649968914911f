"""Options and output shared by the ``pddlink sim`` commands (``pddlink.cli.sim``,
``pddlink.cli.sim_traces``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from pddlink.sim.workload import DEFAULT_WORKLOAD

workload_opt = click.option(
    "--workload", "workload_path", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_WORKLOAD,
    show_default=True, help="Workload file (agentic-v1.json format).",
)  # fmt: skip


def slo_options(f: Any) -> Any:
    """``--slo-ttft-ms`` and ``--slo-tpot-ms``: the SLOs goodput counts against."""
    ttft = click.option(
        "--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True),
        help="TTFT SLO in ms (default: the workload's TTFT bound, 30000).",
    )  # fmt: skip
    tpot = click.option(
        "--slo-tpot-ms", type=click.FloatRange(min=0, min_open=True),
        help="TPOT SLO in ms; the bounded policy's decode-speed bound (default: the workload's, 30).",
    )  # fmt: skip
    return ttft(tpot(f))


def log(msg: str) -> None:
    """Progress: stderr (stdout carries the one JSON object of ``--json``)."""
    click.echo(msg, err=True)
