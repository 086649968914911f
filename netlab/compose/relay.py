"""The compose lab's WAN: ``python -m netlab.compose.relay --lab-dir /lab --dc-a CIDR --dc-b CIDR``.

Runs in the relay container, which joins both datacenter networks. It creates two TUN devices,
``wan-a`` and ``wan-b``, and routes by incoming interface: whatever arrives from dc-a's network goes
into ``wan-a``, whatever arrives from dc-b's into ``wan-b``. netlab's ``TunRelay`` reads a packet
from ``wan-a``, gives it the profile's ``a_to_b`` fate (delay, loss, rate, outages...) and writes it
to ``wan-b``, where the kernel forwards it on to dc-b; the reverse direction likewise. So every
packet between the two networks crosses the link model, as in the namespaced lab. The container's
sysctls (set by compose) turn forwarding on and reverse-path filtering off: a packet from dc-a
leaves ``wan-b``, not the interface its source lives behind.

The control socket is the namespaced lab's (``<lab-dir>/control.sock``, a host directory mounted
into the container), so ``pddlink lab compose status|outage|profile`` work the same way. Once
packets can flow it writes ``<lab-dir>/relay.ready``; SIGTERM (compose down) ends it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from netlab.control import ControlServer
from netlab.model import LinkModel
from netlab.profile import parse_profile
from netlab.relay import ControlHandler, StopRelay, serve, sharpen_timing
from netlab.tun import open_tun
from netlab.tun_relay import TunRelay
from pddlink.errors import LocalError, PddlinkError

TUN = {"dc-a": "wan-a", "dc-b": "wan-b"}
TABLE = {"dc-a": 100, "dc-b": 101}


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if proc.returncode != 0:
        raise LocalError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def interface_in(subnet: str, addresses: list[dict[str, Any]]) -> str:
    """The interface (from ``ip -j -4 addr``) whose address lies in ``subnet``."""
    net = ipaddress.ip_network(subnet)
    for link in addresses:
        for info in link.get("addr_info", []):
            if ipaddress.ip_address(info["local"]) in net:
                return str(link["ifname"])
    raise LocalError(f"no interface of this container is in {subnet}: is it on both lab networks?")


def route_through_tun(interfaces: dict[str, str], mtu_bytes: int) -> dict[str, int]:
    """Open both TUN devices and send what arrives on each network's interface into its device."""
    fds: dict[str, int] = {}
    for dc, dev in TUN.items():
        fds[dc] = open_tun(dev)
        ip("link", "set", "dev", dev, "mtu", str(mtu_bytes), "up")
        ip("route", "replace", "default", "dev", dev, "table", str(TABLE[dc]))
        ip("rule", "add", "iif", interfaces[dc], "lookup", str(TABLE[dc]), "pref", str(TABLE[dc]))
    return fds


def _stop(_sig: int, _frame: object) -> None:
    raise StopRelay


def run(lab_dir: Path, subnets: dict[str, str]) -> None:
    text = (lab_dir / "profile.toml").read_text()
    name_file = lab_dir / "profile.name"
    profile = parse_profile(text, name=name_file.read_text().strip() if name_file.exists() else "lab")
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, timeout=10, check=True)
    addresses = json.loads(out.stdout)
    interfaces = {dc: interface_in(subnets[dc], addresses) for dc in TUN}
    fds = route_through_tun(interfaces, profile.mtu_bytes)
    sharpen_timing()
    clock = time.monotonic
    model = LinkModel(profile, clock())
    relay = TunRelay(model, fds["dc-a"], fds["dc-b"], clock)
    control = ControlServer(str(lab_dir / "control.sock"))
    handler = ControlHandler(model, relay, clock)
    ready = lab_dir / "relay.ready"
    ready.write_text(json.dumps({"interfaces": interfaces, "tun": TUN, "profile": profile.name}))
    try:
        serve(relay, control, handler, None)
    except StopRelay:
        pass
    finally:
        ready.unlink(missing_ok=True)
        control.close()
        for fd in fds.values():
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netlab.compose.relay", description=__doc__)
    parser.add_argument("--lab-dir", required=True, type=Path)
    parser.add_argument("--dc-a", required=True, help="dc-a's subnet (CIDR)")
    parser.add_argument("--dc-b", required=True, help="dc-b's subnet (CIDR)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        run(args.lab_dir, {"dc-a": args.dc_a, "dc-b": args.dc_b})
    except (PddlinkError, OSError, ValueError) as exc:
        print(f"relay: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
