"""``pddlink lab net up|down|status|exec|outage|profile``: the netlab WAN emulator from the shell.

``up`` returns once the lab is ready and leaves its relay running in the background; ``down``
removes it. Several labs can run at once under different ``--name``s. The work is done by
``netlab.Lab``; this module only parses options and prints.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import click

from netlab import state as labstate
from netlab.lab import Lab
from pddlink.cli.outage import apply_outage
from pddlink.errors import InvalidInput, PddlinkError

NAME_OPTION = click.option(
    "--name", default="default", show_default=True, help="Which lab (several may run)."
)

UP_HELP = """Bring datacenters dc-a and dc-b up, joined by an emulated WAN with PROFILE.

PROFILE is a TOML file or a built-in name (clean, metro, wan-1000km, lossy-longhaul). Prints the
datacenters' namespaces and addresses once packets flow, then returns; the relay stays in the
background until `pddlink lab net down`.

Modes: netns (root): network namespaces with 198.18.0.0/15 addresses and a user-space relay over
TUN devices applying every impairment to every packet. loopback (any user): no namespaces;
relays on 127.0.0.1 ports forward to services on 127.0.0.1. Loopback limits: the UDP relay applies
every impairment per datagram; the TCP relay terminates TCP and applies only delay, rate and
outages to the byte stream (no loss, reordering, duplication or corruption: TCP would hide them);
both are single-threaded Python (roughly up to a few hundred Mbit/s); forwards are declared with
--forward PROTO:DC:PORT[=RELAY] (dc-a processes reach dc-b's PORT through the printed relay port;
=RELAY pins it, so that configuration files can name it once).
"""


def _emit(obj: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(obj))
    else:
        for key, value in obj.items():
            click.echo(f"{key}: {json.dumps(value)}")


def _parse_forward(spec: str) -> tuple[str, str, int, int]:
    """PROTO:DC:PORT[=LISTEN]: LISTEN pins the relay port (configuration files can then name it)."""
    try:
        head, _, listen = spec.partition("=")
        proto, dc, port = head.split(":")
        if proto not in ("tcp", "udp") or dc not in ("dc-a", "dc-b"):
            raise ValueError
        return proto, dc, int(port), int(listen or 0)
    except ValueError:
        raise InvalidInput(
            f"--forward {spec!r}: use PROTO:DC:PORT[=RELAY_PORT], e.g. udp:dc-b:4433 or tcp:dc-b:7440=17440"
        ) from None


def _hostport(endpoint: tuple[str, int]) -> str:
    return f"{endpoint[0]}:{endpoint[1]}"


def _interrupt_on_term(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


@click.group(name="lab")
def group() -> None:
    """Emulated datacenters and the WAN between them (netlab)."""


@group.group(name="net")
def net() -> None:
    """Two datacenters joined by an emulated WAN: up, down, status, exec, outage, profile."""


@net.command(name="up", help=UP_HELP)
@click.option("--profile", "profile", default="clean", show_default=True, help="TOML file or built-in name.")
@NAME_OPTION
@click.option("--mode", type=click.Choice(["auto", "netns", "loopback"]), default="auto", show_default=True)
@click.option("--loopback", is_flag=True, help="Same as --mode loopback.")
@click.option(
    "--forward",
    "forwards",
    multiple=True,
    metavar="PROTO:DC:PORT[=RELAY]",
    help="Loopback relay for DC's PORT; =RELAY pins the relay's port (configs can name it).",
)
@click.option("--timeout", "timeout_s", type=float, default=30.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def up(
    profile: str,
    name: str,
    mode: str,
    loopback: bool,
    forwards: tuple[str, ...],
    timeout_s: float,
    as_json: bool,
) -> None:
    wanted = [_parse_forward(f) for f in forwards]
    previous = signal.signal(signal.SIGTERM, _interrupt_on_term)  # a killed `up` cleans up too
    try:
        lab = Lab.up(
            profile, name=name, mode="loopback" if loopback else mode, owner=False, timeout_s=timeout_s
        )
        try:
            out = lab.describe()
            if wanted:  # netns mode: no relay ports, the dc's own address (ready-made peer addresses)
                out["forwards"] = {
                    f"{p}:{dc}:{port}": _hostport(lab.endpoint(dc, port, p, listen))
                    for p, dc, port, listen in wanted
                }
        except BaseException:
            lab.down()
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    _emit(out, as_json)


@net.command(name="down")
@NAME_OPTION
@click.option("--stale", is_flag=True, help="Remove every lab whose relay is gone (leftovers of crashes).")
@click.option("--all", "all_labs", is_flag=True, help="Remove every lab, also those others are using.")
@click.option("--json", "as_json", is_flag=True)
def down(name: str, stale: bool, all_labs: bool, as_json: bool) -> None:
    """Remove a lab: relay, namespaces, TUN devices, processes. Idempotent."""
    if all_labs or stale:
        names = [s.name for s in labstate.list_labs() if all_labs or not labstate.in_use(s)]
    else:
        names = [labstate.check_name(name)]
    removed = [n for n in names if labstate.teardown(n)]
    if as_json:
        click.echo(json.dumps({"removed": removed}))
    elif removed:
        click.echo(f"removed {', '.join(removed)}", err=True)


@net.command(name="status")
@click.option("--name", default=None, help="One lab (default: every lab).")
@click.option("--json", "as_json", is_flag=True)
def status(name: str | None, as_json: bool) -> None:
    """The running labs: datacenters, profile, outage, packet counters."""
    names = [name] if name else [s.name for s in labstate.list_labs()]
    labs: dict[str, Any] = {}
    for n in names:
        try:
            labs[n] = Lab.attach(n).status()
        except PddlinkError as exc:  # a half-dead lab is reported, not fatal
            labs[n] = {"error": str(exc)}
    _emit({"labs": labs}, as_json)


@net.command(name="exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@NAME_OPTION
@click.argument("dc", type=click.Choice(["dc-a", "dc-b"]))
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(name: str, dc: str, argv: tuple[str, ...]) -> None:
    """Run a command inside datacenter DC: pddlink lab net exec dc-a -- CMD ARGS..."""
    lab = Lab.attach(name)
    args = list(argv[1:] if argv and argv[0] == "--" else argv)
    full = lab.exec_argv(dc, args)
    sys.stdout.flush()
    os.execvp(full[0], full)


@net.command(name="outage")
@NAME_OPTION
@click.option("--seconds", type=float, default=None, help="Cut the WAN for this long.")
@click.option("--on/--off", "switch", default=None, help="Cut until --off / restore now.")
@click.option(
    "--direction", type=click.Choice(["both", "a_to_b", "b_to_a"]), default="both", show_default=True
)
def outage(name: str, seconds: float | None, switch: bool | None, direction: str) -> None:
    """Cut the WAN for --seconds, or --on until --off (both directions unless --direction)."""
    apply_outage(Lab.attach(name), seconds, switch, direction)


@net.command(name="profile")
@NAME_OPTION
@click.argument("profile")
def profile(name: str, profile: str) -> None:
    """Replace the running lab's link profile live (TOML file or built-in name)."""
    Lab.attach(name).set_profile(profile)


from pddlink.cli.lab_compose import compose  # noqa: E402 (the compose lab's commands, own module)

group.add_command(compose)
