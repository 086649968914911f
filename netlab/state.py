"""What a lab leaves on the machine, recorded before it is created, so anything can be cleaned up.

Each lab has a directory ``<run root>/<name>/`` (``/run/pddlink-netlab`` as root, a per-user
temporary directory otherwise) holding ``state.json`` (namespaces, addresses, TUN names, relay pid),
the profile, the relay's log and its control socket. ``Lab.up`` writes the record *before* creating
each thing, so ``teardown`` can remove the leftovers of a run that was interrupted or killed at any
point. ``teardown`` is idempotent: it stops the relay (only if its command line names this lab),
ends every process inside the lab's namespaces, deletes the namespaces and any TUN device still in
the root namespace, and removes the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pddlink.errors import InvalidInput, LocalError

DATACENTERS = ("dc-a", "dc-b")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,23}$")
MAX_SLOTS = 256


def run_root() -> Path:
    if os.geteuid() == 0:
        return Path("/run/pddlink-netlab")
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"pddlink-netlab-{os.geteuid()}"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidInput(
            f"lab name {name!r}: use 1-24 of a-z, 0-9 and '-', starting with a letter or digit"
        )
    return name


def netns_names(name: str) -> dict[str, str]:
    """The namespace of each datacenter: ``pdl-dc-a`` for the default lab, ``pdl-<name>-dc-a`` otherwise."""
    prefix = "pdl" if name == "default" else f"pdl-{name}"
    return {dc: f"{prefix}-{dc}" for dc in DATACENTERS}


@dataclass(slots=True)
class LabState:
    """The record of one lab (JSON in ``state.json``)."""

    name: str
    mode: str
    slot: int
    netns: dict[str, str] = field(default_factory=dict)
    addr: dict[str, str] = field(default_factory=dict)
    tun: dict[str, str] = field(default_factory=dict)
    host_links: list[str] = field(default_factory=list)
    mtu_bytes: int = 1500
    relay_pid: int = 0
    owner_pid: int = 0
    creator_pid: int = 0
    forwards: list[dict[str, object]] = field(default_factory=list)

    @property
    def directory(self) -> Path:
        return run_root() / self.name

    @property
    def control_path(self) -> str:
        return str(self.directory / "control.sock")

    def save(self) -> None:
        tmp = self.directory / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.directory / "state.json")


def read_state(name: str) -> LabState | None:
    path = run_root() / name / "state.json"
    try:
        data = json.loads(path.read_text())
        return LabState(**data)
    except (FileNotFoundError, ValueError, TypeError):
        return None


def list_labs() -> list[LabState]:
    root = run_root()
    if not root.is_dir():
        return []
    found = (read_state(p.name) for p in sorted(root.iterdir()) if p.is_dir())
    return [s for s in found if s is not None]


@contextlib.contextmanager
def registry_lock() -> Iterator[None]:
    root = run_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def allocate(name: str, mode: str) -> LabState:
    """Reserve a slot (distinct addresses and TUN names per lab) and record the lab. Hold registry_lock."""
    used = {s.slot for s in list_labs()}
    slot = next((i for i in range(MAX_SLOTS) if i not in used), None)
    if slot is None:
        raise LocalError(f"all {MAX_SLOTS} lab slots are in use")
    state = LabState(name=name, mode=mode, slot=slot, creator_pid=os.getpid())
    state.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    state.save()
    return state


def relay_alive(state: LabState) -> bool:
    return state.relay_pid > 0 and _is_our_relay(state.relay_pid, state.name)


def in_use(state: LabState) -> bool:
    """The lab runs, or another live process is still creating it."""
    creator = state.creator_pid
    creating = creator not in (0, os.getpid()) and _exists(creator) and not state.relay_pid
    return relay_alive(state) or creating


def _is_our_relay(pid: int, name: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"netlab.relay" in cmdline and str(run_root() / name).encode() in cmdline


def ip(*args: str, check: bool = True, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; a failure raises LocalError with ip's message."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and proc.returncode != 0:
        raise LocalError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def existing_netns() -> set[str]:
    if shutil.which("ip") is None:  # loopback mode on a machine without iproute2
        return set()
    out = ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _signal_and_wait(pids: list[int], deadline_s: float = 2.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and any(_exists(p) for p in pids):
            time.sleep(0.02)
        pids = [p for p in pids if _exists(p)]
        if not pids:
            return


def relay_pids(name: str) -> list[int]:
    """Every live relay process of lab ``name`` (found by command line, so also an unrecorded one)."""
    me = os.getpid()
    pids = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    return [p for p in pids if p != me and _is_our_relay(p, name) and _exists(p)]


def _exists(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _netns_pids(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def teardown(name: str) -> bool:
    """Remove everything of lab ``name``; True when something was there. Idempotent."""
    state = read_state(name)
    found = state is not None
    relays = relay_pids(name)
    if relays:
        _signal_and_wait(relays)
    namespaces = set(netns_names(name).values()) | set(state.netns.values() if state else ())
    present = namespaces & existing_netns()
    for ns in sorted(present):
        _signal_and_wait(_netns_pids(ns))
        ip("netns", "del", ns, check=False)
    for dev in [*state.tun.values(), *state.host_links] if state else ():
        if Path(f"/sys/class/net/{dev}").exists():
            ip("link", "del", dev, check=False)
    directory = run_root() / name
    if directory.exists():
        shutil.rmtree(directory, ignore_errors=True)
    return found or bool(present) or bool(relays)
