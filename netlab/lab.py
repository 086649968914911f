"""``Lab``: bring two emulated datacenters up, run processes in them, cut the WAN, tear it all down.

    with Lab.up("wan-1000km", name="mytest") as lab:
        server = lab.popen("dc-b", ["iperf3", "-s", "-1"])
        host, port = lab.endpoint("dc-b", 5201)          # where dc-a reaches dc-b's port 5201
        lab.run("dc-a", ["iperf3", "-c", host, "-p", str(port)], timeout_s=30)
        lab.outage(3.0)                                  # cut the WAN for 3 s (both directions)

Modes. ``netns`` (root): ``dc-a`` and ``dc-b`` are network namespaces with addresses from
198.18.0.0/15, joined by a relay over TUN devices that applies the profile to every packet.
``loopback`` (any user): no namespaces; the relay listens on 127.0.0.1 ports and forwards to
services on 127.0.0.1 (UDP with every impairment, TCP with delay, rate and outages only);
``endpoint`` returns the relay's port. ``auto`` picks ``netns`` as root, ``loopback`` otherwise.

The host (the root namespace) reaches ``lab.addr(dc)`` of both datacenters directly, over a veth
that carries no impairment (for control and measurement); dc-a <-> dc-b traffic always crosses the
WAN.

Lifecycle. ``up`` records the lab under ``/run/pddlink-netlab/<name>/`` before creating anything
and removes everything it made if it is interrupted. The relay runs in the background; when the
lab has an owner (the default for ``Lab.up``; the CLI's ``up`` has none) and the owner process dies,
the relay removes the lab itself. ``down`` (or leaving the ``with`` block) removes the namespaces,
the relay, every process started in the lab and the TUN devices; it is idempotent.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from netlab import control
from netlab import state as labstate
from netlab.profile import Profile, ProfileSource, profile_to_toml
from netlab.state import DATACENTERS, LabState, ip
from pddlink.errors import DeadlineExceeded, InvalidInput, LocalError, NotFound, Unavailable

MODES = ("auto", "netns", "loopback")
NETNS_SYSCTLS = (
    "net.ipv4.tcp_rmem=4096 131072 134217728",
    "net.ipv4.tcp_wmem=4096 16384 134217728",
    "net.ipv4.tcp_no_metrics_save=1",
    "net.ipv6.conf.all.disable_ipv6=1",
    "net.ipv6.conf.default.disable_ipv6=1",
)


def _profile_source(profile: Profile | str | os.PathLike[str]) -> ProfileSource:
    if isinstance(profile, Profile):
        return ProfileSource(profile, profile_to_toml(profile))
    return ProfileSource.load(os.fspath(profile))


def _check_dc(dc: str) -> str:
    if dc not in DATACENTERS:
        raise InvalidInput(f"unknown datacenter {dc!r}: use 'dc-a' or 'dc-b'")
    return dc


class Lab:
    """A running lab; obtain one with ``Lab.up`` or ``Lab.attach``."""

    def __init__(self, state: LabState) -> None:
        self._state = state
        self._forward_cache: dict[tuple[str, int, str], int] = {}
        self._children: list[subprocess.Popen[Any]] = []

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        profile: Profile | str | os.PathLike[str] = "clean",
        name: str = "default",
        *,
        mode: str = "auto",
        owner: bool = True,
        timeout_s: float = 20.0,
    ) -> Lab:
        """Create and start a lab; returns once packets flow. Nothing is left behind on failure."""
        source = _profile_source(profile)  # validate before anything exists
        labstate.check_name(name)
        if mode not in MODES:
            raise InvalidInput(f"lab mode {mode!r}: use one of {', '.join(MODES)}")
        if mode == "auto":
            mode = "netns" if os.geteuid() == 0 else "loopback"
        if mode == "netns" and os.geteuid() != 0:
            raise Unavailable("the namespaced lab needs root; use mode 'loopback' (--loopback) instead")
        with labstate.registry_lock():
            old = labstate.read_state(name)
            if old is not None and labstate.in_use(old):
                raise InvalidInput(f"lab {name!r} is already up (pddlink lab net down --name {name})")
            labstate.teardown(name)  # leftovers of a killed run
            state = labstate.allocate(name, mode)
        try:
            cls._build(state, source, owner, timeout_s)
        except BaseException:
            labstate.teardown(name)
            raise
        return cls(state)

    @classmethod
    def _build(cls, state: LabState, source: ProfileSource, owner: bool, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state.owner_pid = os.getpid() if owner else 0
        state.mtu_bytes = source.profile.mtu_bytes
        if state.mode == "netns":
            state.netns = labstate.netns_names(state.name)
            state.addr = {"dc-a": f"198.18.{state.slot}.1", "dc-b": f"198.18.{state.slot}.2"}
            state.tun = {dc: f"pdl{state.slot}{dc[-1]}" for dc in DATACENTERS}
            state.host_links = [f"pdl{state.slot}h{dc[-1]}" for dc in DATACENTERS]
        else:
            state.addr = dict.fromkeys(DATACENTERS, "127.0.0.1")
        state.save()  # recorded before created
        if state.mode == "netns":
            for i, dc in enumerate(DATACENTERS):
                _make_netns(state.netns[dc])
                _host_link(state, dc, state.host_links[i], 4 * i)
        (state.directory / "profile.toml").write_text(source.text)
        (state.directory / "profile.name").write_text(source.profile.name)
        _start_relay(state, deadline)

    @classmethod
    def attach(cls, name: str = "default") -> Lab:
        """The running lab ``name`` (for example one started by ``pddlink lab net up``)."""
        state = labstate.read_state(labstate.check_name(name))
        if state is None or not labstate.relay_alive(state):
            raise NotFound(f"no lab named {name!r} is up")
        return cls(state)

    def down(self) -> None:
        """Remove the lab and everything in it (also processes ``popen`` started). Idempotent."""
        for child in self._children:  # in loopback mode there is no namespace to find them by
            if child.poll() is None:
                child.terminate()
        for child in self._children:
            try:
                child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=2)
        self._children.clear()
        labstate.teardown(self._state.name)

    def __enter__(self) -> Lab:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.down()

    # ---- where things are ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._state.name

    @property
    def mode(self) -> str:
        return self._state.mode

    @property
    def mtu_bytes(self) -> int:
        """The WAN's MTU (the profile's ``mtu_bytes``): the largest IP packet between datacenters."""
        return self._state.mtu_bytes

    def addr(self, dc: str) -> str:
        """The IPv4 address of datacenter ``dc`` (127.0.0.1 in loopback mode)."""
        return self._state.addr[_check_dc(dc)]

    def netns(self, dc: str) -> str:
        """The network namespace of ``dc`` ('' in loopback mode)."""
        return self._state.netns.get(_check_dc(dc), "")

    def endpoint(self, dc: str, port: int, proto: str = "tcp", listen_port: int = 0) -> tuple[str, int]:
        """Where the *other* datacenter reaches ``dc``'s ``port`` across the WAN (loopback mode: a
        relay port, ``listen_port`` if given)."""
        _check_dc(dc)
        if self.mode == "netns":
            return self.addr(dc), port
        key = (dc, port, proto)
        if key not in self._forward_cache:
            req = {"op": "forward", "dc": dc, "port": port, "proto": proto, "listen_port": listen_port}
            reply = self._control(req)
            self._forward_cache[key] = int(reply["listen_port"])
        return "127.0.0.1", self._forward_cache[key]

    def describe(self) -> dict[str, Any]:
        """``{"dc-a": {"netns", "addr"}, "dc-b": {...}}``: the JSON of ``lab net up --json``."""
        return {dc: {"netns": self.netns(dc), "addr": self.addr(dc)} for dc in DATACENTERS}

    # ---- running things inside ---------------------------------------------------------------
    def exec_argv(self, dc: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside ``dc`` (unchanged in loopback mode)."""
        ns = self.netns(dc)
        return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)

    def popen(self, dc: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``dc``; ``down`` ends it if it is still running."""
        child = subprocess.Popen(self.exec_argv(dc, argv), **kwargs)
        self._children.append(child)
        return child

    def run(
        self, dc: str, argv: Sequence[str], *, timeout_s: float, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside ``dc`` to completion (``subprocess.run`` keywords accepted)."""
        return subprocess.run(self.exec_argv(dc, argv), timeout=timeout_s, check=False, **kwargs)

    # ---- the WAN at run time -----------------------------------------------------------------
    def set_outage(self, on: bool, direction: str = "both") -> None:
        """Cut the WAN (packets in flight are lost) until ``set_outage(False)``.

        ``direction``: ``both`` (a partition), ``a_to_b`` or ``b_to_a`` (a one-way cut)."""
        op = {"op": "outage", "seconds": None} if on else {"op": "restore"}
        self._control({**op, "direction": direction})

    def outage(self, seconds: float, direction: str = "both") -> None:
        """Cut the WAN for ``seconds`` from now; it comes back by itself."""
        if not seconds >= 0:
            raise InvalidInput(f"outage seconds {seconds!r} must be >= 0")
        self._control({"op": "outage", "seconds": float(seconds), "direction": direction})

    def set_profile(self, profile: Profile | str | os.PathLike[str]) -> None:
        """Replace the link model live (queues and loss state start afresh)."""
        source = _profile_source(profile)
        self._control({"op": "profile", "toml": source.text, "name": source.profile.name})

    def status(self) -> dict[str, Any]:
        """The relay's view: profile, uptime, outage, per-direction packet counters."""
        reply = self._control({"op": "status"})
        reply.pop("ok", None)
        return {"name": self.name, "mode": self.mode, **self.describe(), **reply}

    def _control(self, message: dict[str, Any]) -> dict[str, Any]:
        return control.request(self._state.control_path, message)


def _make_netns(ns: str) -> None:
    ip("netns", "add", ns)
    ip("-n", ns, "link", "set", "lo", "up")
    cmd = ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *NETNS_SYSCTLS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    if proc.returncode != 0:
        raise LocalError(f"sysctl in {ns}: {proc.stderr.strip()}")


def _host_link(state: LabState, dc: str, host_if: str, base: int) -> None:
    """A direct veth from the host into ``dc`` (198.19.<slot>.<base>/30) and a host route to its address.

    For control and measurement from the host (HTTP APIs, metrics): it carries no impairment, and
    neither datacenter routes to the other through it, so dc-a <-> dc-b traffic always crosses the WAN."""
    ns, net = state.netns[dc], f"198.19.{state.slot}"
    ip("link", "add", host_if, "type", "veth", "peer", "name", "host0", "netns", ns)
    ip("addr", "add", f"{net}.{base + 1}/30", "dev", host_if)
    ip("link", "set", host_if, "up")
    ip("-n", ns, "addr", "add", f"{net}.{base + 2}/30", "dev", "host0")
    ip("-n", ns, "link", "set", "host0", "up")
    ip("route", "replace", f"{state.addr[dc]}/32", "via", f"{net}.{base + 2}")


def _start_relay(state: LabState, deadline: float) -> None:
    log = open(state.directory / "relay.log", "wb")  # noqa: SIM115 - handed to the child
    with log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "netlab.relay", "--lab-dir", str(state.directory)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": _package_root()},
        )
    state.relay_pid = proc.pid
    state.save()
    assert proc.stdout is not None
    with proc.stdout:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded("the lab's relay did not become ready in time")
            readable, _, _ = select.select([proc.stdout], [], [], left)
            if readable:
                line = proc.stdout.readline()
                if line.strip() == b"ready":
                    return
                proc.wait(timeout=5)
                reason = (state.directory / "relay.log").read_text().strip().splitlines()
                raise LocalError(f"the lab's relay failed: {reason[-1] if reason else proc.returncode}")


def _package_root() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    extra = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{extra}" if extra else root
