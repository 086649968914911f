"""The same profiles for a kernel with ``tc netem``: used by the Docker compose lab's WAN gateways.

``python -m netlab.netem PROFILE --direction a_to_b --subnet 198.18.30.0/24 [--apply]`` prints (or
runs) the ``tc`` command that makes the interface holding an address in SUBNET apply one
direction of PROFILE on egress. netem has no outage schedule: ``[[outage]]`` entries are refused
here rather than silently ignored. netem's ``rate`` counts IP packets as this project's relay does;
``queue_packets`` becomes netem's ``limit`` (netem has no byte limit: ``queue_bytes`` is converted
at 1,500 bytes per packet). ``mtu_bytes`` is the Docker networks' business (``driver_opts``
``com.docker.network.driver.mtu``), not netem's.
"""

from __future__ import annotations

import argparse
import ipaddress
import shlex
import subprocess
import sys

from netlab.profile import DIRECTIONS, DirectionSpec, Profile, load_profile
from pddlink.errors import ConfigError, PddlinkError

DEFAULT_LIMIT_PACKETS = 10_000


def _ms(value: float) -> str:
    return f"{value:g}ms"


def _pct(p: float) -> str:
    return f"{100.0 * p:g}%"


def netem_args(spec: DirectionSpec, seed: int) -> list[str]:
    """netem's arguments for one direction (after ``tc qdisc replace dev DEV root netem``)."""
    args: list[str] = []
    limit = spec.queue_packets or (spec.queue_bytes // 1500) or DEFAULT_LIMIT_PACKETS
    args += ["limit", str(limit)]
    if spec.delay_ms or spec.jitter_ms:
        args += ["delay", _ms(spec.delay_ms)]
        if spec.jitter_ms:
            args += [
                _ms(spec.jitter_ms),
                "distribution",
                "paretonormal" if spec.distribution == "pareto" else "normal",
            ]
    ge = spec.gilbert_elliott
    if ge is not None:  # netem has one loss model: fold the independent loss into both GE states
        keep = 1.0 - spec.loss
        bad, good = 1.0 - (1.0 - ge.loss_bad) * keep, 1.0 - (1.0 - ge.loss_good) * keep
        args += ["loss", "gemodel", _pct(ge.p), _pct(ge.r), _pct(bad), _pct(good)]  # p r 1-h 1-k
    elif spec.loss:
        args += ["loss", "random", _pct(spec.loss)]
    if spec.duplicate:
        args += ["duplicate", _pct(spec.duplicate)]
    if spec.corrupt:
        args += ["corrupt", _pct(spec.corrupt)]
    if spec.reorder:
        args += ["reorder", _pct(spec.reorder)]
    if spec.rate_mbit:
        args += ["rate", f"{spec.rate_mbit:g}mbit"]
    return [*args, "seed", str(seed)]


def tc_command(profile: Profile, direction: str, dev: str) -> list[str]:
    if profile.outages:
        raise ConfigError("profile field outage: netem cannot schedule outages (use the netlab relay)")
    return [
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "netem",
        *netem_args(profile.direction(direction), profile.seed),
    ]


def device_in(subnet: str) -> str:
    """The interface holding an IPv4 address in ``subnet``."""
    net = ipaddress.ip_network(subnet)
    out = subprocess.run(
        ["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    for line in out.splitlines():
        parts = line.split()
        if ipaddress.ip_interface(parts[3]).ip in net:
            return parts[1]
    raise ConfigError(f"no interface has an address in {subnet}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netlab.netem", description=__doc__)
    parser.add_argument("profile")
    parser.add_argument("--direction", choices=DIRECTIONS, required=True)
    parser.add_argument("--dev", help="interface (default: the one in --subnet)")
    parser.add_argument("--subnet", default="198.18.30.0/24")
    parser.add_argument("--apply", action="store_true", help="run tc instead of printing the command")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile)
        cmd = tc_command(
            profile, args.direction, args.dev or (device_in(args.subnet) if args.apply else "DEV")
        )
    except PddlinkError as exc:
        print(f"netem: {exc}", file=sys.stderr)
        return 2
    if not args.apply:
        print(shlex.join(cmd))
        return 0
    return subprocess.run(cmd, check=False, timeout=10).returncode


if __name__ == "__main__":
    sys.exit(main())
