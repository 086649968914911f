"""The relay process of a lab: ``python -m netlab.relay --lab-dir DIR``.

Started in the background by ``Lab.up`` (its own session, so a terminal's Ctrl-C does not reach
it). Namespaced mode: it creates the two TUN devices, moves them into the datacenters' namespaces
and addresses them, then prints ``ready`` on stdout and relays packets until it is told to stop
(SIGTERM or the control socket's ``stop``). Loopback mode: it runs the UDP/TCP relays of
``netlab.loopback``. If the lab has an owner process (a test holding a ``Lab``) and that process
dies, the relay removes the whole lab itself, so a crashed test leaves nothing behind.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from pathlib import Path

from netlab import state as labstate
from netlab.control import ControlServer
from netlab.model import LinkModel
from netlab.profile import parse_profile
from netlab.relay_control import ControlHandler, owner_fd, sharpen_timing
from netlab.state import LabState, ip
from netlab.tun import open_tun
from netlab.tun_relay import TunRelay
from pddlink.errors import PddlinkError


class StopRelay(Exception):
    """Raised by the SIGTERM handler to leave the loop."""


def _stop(_sig: int, _frame: object) -> None:
    raise StopRelay


def configure_tun(state: LabState, mtu_bytes: int) -> dict[str, int]:
    """Create both TUN devices, move each into its namespace as ``wan0`` and address it."""
    fds: dict[str, int] = {}
    for dc, dev in state.tun.items():
        fds[dc] = open_tun(dev)
        ns = state.netns[dc]
        ip("link", "set", "dev", dev, "netns", ns)
        ip("-n", ns, "link", "set", "dev", dev, "name", "wan0")
        ip("-n", ns, "addr", "add", f"{state.addr[dc]}/24", "dev", "wan0")
        ip("-n", ns, "link", "set", "dev", "wan0", "mtu", str(mtu_bytes), "up")
    return fds


def run_netns(state: LabState, lab_dir: Path) -> bool:
    """Relay until stopped; True when the owner died (the caller then removes the lab)."""
    clock = time.monotonic
    text = (lab_dir / "profile.toml").read_text()
    profile = parse_profile(text, name=_profile_name(lab_dir))
    fds = configure_tun(state, profile.mtu_bytes)
    sharpen_timing()
    model = LinkModel(profile, clock())
    relay = TunRelay(model, fds["dc-a"], fds["dc-b"], clock)
    control = ControlServer(state.control_path)
    handler = ControlHandler(model, relay, clock)
    owner = owner_fd(state)
    print("ready", flush=True)
    try:
        return serve(relay, control, handler, owner)
    except StopRelay:
        return False
    finally:
        control.close()
        for fd in fds.values():
            os.close(fd)


def serve(relay: TunRelay, control: ControlServer, handler: ControlHandler, owner: int | None) -> bool:
    """Move packets and answer control requests until ``stop``; True when the owner died.

    Shared by the namespaced lab and the compose lab's relay container (``netlab.compose.relay``)."""
    clock = relay.clock
    watch = [*relay.fds, control.fileno(), *([owner] if owner is not None else [])]
    while not handler.stopping:
        readable, _, _ = select.select(watch, [], [], relay.timeout_s(clock()))
        for fd in readable:
            if fd == owner:
                return True
            if fd == control.fileno():
                control.serve_one(handler)
            else:
                relay.on_readable(fd)
        relay.flush()
    return False


def _profile_name(lab_dir: Path) -> str:
    name_file = lab_dir / "profile.name"
    return name_file.read_text().strip() if name_file.exists() else "lab"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netlab.relay", description=__doc__)
    parser.add_argument("--lab-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    state = labstate.read_state(args.lab_dir.name)
    if state is None:
        print(f"relay: no lab state in {args.lab_dir}", file=sys.stderr)
        return 2
    try:
        if state.mode == "loopback":
            from netlab.loopback import run_loopback

            owner_died = run_loopback(state, args.lab_dir)
        else:
            owner_died = run_netns(state, args.lab_dir)
    except StopRelay:
        return 0
    except (PddlinkError, OSError) as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1
    if owner_died:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        labstate.teardown(state.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
