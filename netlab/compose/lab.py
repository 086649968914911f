"""``ComposeLab``: the two datacenters as docker networks, the WAN as a netlab relay container.

    lab = ComposeLab.up("wan-1000km", name="default")   # engine, networks, relay; returns once it relays
    lab.deploy(config_dir, run_dir)                      # router, P, RLD, MD containers, waits until ready
    lab.measure_wan()                                    # RTT (ping) and rate (iperf3), p -> md
    lab.outage(3.0)                                      # cut the WAN (the relay's control socket)
    lab.undeploy(); lab.down()                           # no container, network, rule or dockerd left

Each lab has a name, a slot (its subnets ``198.19.(240+2k).0/24`` and ``.(241+2k).0/24`` and its
bridges ``pdlc<k>a``/``pdlc<k>b``) and a directory ``/run/pddlink-compose/labs/<name>/`` holding
its record, the profile, the relay's control socket and readiness file, the dev PKI (``pki/all``,
the CA in ``pki/all/ca``; each role's container mounts only ``pki/<role>``: CA certificate, its
certificate and key), the roles' bearer keys (``keys/<role>/``: ``api-keys`` for the router's HTTP
API, ``admin-keys`` for a sidecar's admin port; random, 0600, mounted at ``/keys``) and the
roles' logs. The compose project is ``pddlink-<name>``; ``down`` removes its containers and networks
by the project's label, so it also cleans up after a run that was killed.

With bridge netfilter on (``net.bridge.bridge-nf-call-iptables=1``), bridged frames go through the
host's FORWARD chain, where dockerd drops anything on an internal network that is not addressed
within it; a dc-a frame bound for dc-b goes to the relay inside dc-a's bridge, so the lab accepts
frames that stay on one of its bridges (``DOCKER-USER``) and removes that rule again on ``down``.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from netlab import control
from netlab.compose import engine as engines
from netlab.compose.engine import STATE_ROOT, Engine
from netlab.compose.images import IMAGE, image_exists
from netlab.profile import Profile, ProfileSource, profile_to_toml
from pddlink.errors import DeadlineExceeded, InvalidInput, LocalError, NotFound

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
DEFAULT_CONFIG = REPO / "docker" / "config"
LABS = STATE_ROOT / "labs"
ROLES = ("md", "rld", "p", "router")
ENGINES = ("md-engine", "rld-engine", "p-engine")  # the vLLM servers beside the sidecars (deploy_vllm)
ROLE_DC = {"p": "dc-a", "rld": "dc-a", "router": "dc-a", "md": "dc-b", "probe-a": "dc-a", "probe-b": "dc-b"}
PROBES = ("probe-a", "probe-b")
HOST_NUMBER = {"relay": 2, "p": 10, "rld": 11, "router": 20, "md": 10, "probe-a": 30, "probe-b": 30}
IDENTITY = {"p": "p0", "rld": "rld0", "md": "md0", "router": "router0"}
KEY_FILE = {"p": "admin-keys", "rld": "admin-keys", "md": "admin-keys", "router": "api-keys"}
ROLE_UID = 10001  # the image's pddlink user
MAX_SLOTS = 8
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,23}$")


@dataclass(frozen=True, slots=True)
class LabRecord:
    name: str
    slot: int

    @property
    def project(self) -> str:
        return f"pddlink-{self.name}"

    @property
    def directory(self) -> Path:
        return LABS / self.name

    def net(self, dc: str) -> str:
        """The first three octets of ``dc``'s /24."""
        return f"198.19.{240 + 2 * self.slot + (dc == 'dc-b')}"

    def bridge(self, dc: str) -> str:
        return f"pdlc{self.slot}{dc[-1]}"

    def addr(self, role: str) -> str:
        dc = ROLE_DC.get(role, "dc-a")
        return f"{self.net(dc)}.{HOST_NUMBER[role]}"


@dataclass(frozen=True, slots=True)
class WanMeasurement:
    """The WAN as measured between the p and md containers, next to the profile."""

    rtt_ms: float
    rtt_ms_profile: float
    pings: int
    goodput_mbit: float
    rate_mbit: float  # goodput counted in IP bytes, as the profile's rate is
    rate_mbit_profile: float | None

    def within(self, tolerance: float) -> bool:
        ok_rtt = abs(self.rtt_ms - self.rtt_ms_profile) <= tolerance * self.rtt_ms_profile
        ok_rate = self.rate_mbit_profile is None or (
            abs(self.rate_mbit - self.rate_mbit_profile) <= tolerance * self.rate_mbit_profile
        )
        return ok_rtt and ok_rate


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidInput(
            f"lab name {name!r}: use 1-24 of a-z, 0-9 and '-', starting with a letter or digit"
        )
    return name


@contextlib.contextmanager
def _labs_lock() -> Iterator[None]:
    LABS.mkdir(parents=True, exist_ok=True)
    with open(LABS / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _records() -> list[LabRecord]:
    out = []
    for state in sorted(LABS.glob("*/state.json")) if LABS.exists() else []:
        with contextlib.suppress(OSError, ValueError, KeyError):
            raw = json.loads(state.read_text())
            out.append(LabRecord(str(raw["name"]), int(raw["slot"])))
    return out


def list_labs() -> list[str]:
    return [r.name for r in _records()]


def _profile_source(profile: Profile | str | os.PathLike[str]) -> ProfileSource:
    if isinstance(profile, Profile):
        return ProfileSource(profile, profile_to_toml(profile))
    return ProfileSource.load(os.fspath(profile))


class ComposeLab:
    """A running compose lab; obtain one with ``up`` or ``attach``."""

    def __init__(self, record: LabRecord, engine: Engine) -> None:
        self.record, self.engine = record, engine
        self.mode = "compose"
        self.run_dir = record.directory / "run"

    # ---- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        profile: Profile | str | os.PathLike[str] = "clean",
        name: str = "default",
        timeout_s: float = 60.0,
    ) -> ComposeLab:
        """Networks and the relay container, relaying with ``profile``. Nothing is left on failure."""
        source = _profile_source(profile)
        check_name(name)
        engine = engines.ensure_engine()
        try:
            if not image_exists(engine, IMAGE):
                raise NotFound(f"image {IMAGE} is not built here: run `pddlink lab compose build` first")
            with _labs_lock():
                if any(r.name == name for r in _records()):
                    raise InvalidInput(f"compose lab {name!r} is already up (pddlink lab compose down)")
                used = {r.slot for r in _records()}
                free = [k for k in range(MAX_SLOTS) if k not in used]
                if not free:
                    raise InvalidInput(f"{MAX_SLOTS} compose labs are up already")
                record = LabRecord(name, free[0])
                _remove_project(engine, name)  # leftovers of a run whose engine died under it
                _make_directory(record, source)
        except BaseException:
            if not _records():
                engines.stop_engine()
            raise
        lab = cls(record, engine)
        try:
            lab._compose(["up", "-d", "--no-color", "relay"], timeout_s=timeout_s)
            lab._accept_bridged(True)
            lab._wait_relay(timeout_s)
        except BaseException:
            lab.down()
            raise
        return lab

    @classmethod
    def attach(cls, name: str = "default") -> ComposeLab:
        record = next((r for r in _records() if r.name == check_name(name)), None)
        engine = engines.running_engine()
        if record is None or engine is None:
            raise NotFound(f"no compose lab named {name!r} is up")
        return cls(record, engine)

    def deploy(
        self, config_dir: Path = DEFAULT_CONFIG, run_dir: Path | None = None, timeout_s: float = 180.0
    ) -> None:
        """Start (or restart) the router, P, RLD and MD containers with ``config_dir``; wait until ready."""
        self.run_dir = run_dir or self.record.directory / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.run_dir, ROLE_UID, ROLE_UID)
        for role in ROLES:
            for sock in (f"{role}.admin.sock", "router.sock", "router.sock.grpc"):
                (self.run_dir / sock).unlink(missing_ok=True)
        self._config_dir = config_dir.resolve()
        deadline = time.monotonic() + timeout_s
        # the sidecars first, then the router (as harness.cluster does): a router that dialed a
        # sidecar before it listened would wait out gRPC's reconnect backoff
        for group in (("md", "rld", "p"), ("router",)):
            self._compose(["up", "-d", "--no-color", "--no-deps", "--force-recreate", *group], timeout_s=120)
            self._wait_roles(group, deadline)

    def deploy_vllm(
        self,
        config_dir: Path,
        run_dir: Path,
        model_dir: Path,
        cpus: dict[str, str],
        engine_port: int,
        timeout_s: float = 600.0,
        roles: tuple[str, ...] = ("md", "rld", "p"),
    ) -> None:
        """The vLLM roles: P, RLD and MD sidecars (``engine = "vllm"`` configs in ``config_dir``) from
        the vLLM image, then each role's vLLM server beside its sidecar (``<role>-engine``, serving
        ``model_dir``/model on ``engine_port``, on ``cpus[role]``), then the router; waits until each
        serves (``roles``: without "rld", P->MD only). ``undeploy`` removes them all."""
        from netlab.compose.vllm_image import VLLM_IMAGE

        if not image_exists(self.engine, VLLM_IMAGE):
            raise NotFound(f"image {VLLM_IMAGE} is not built here: run `pddlink lab compose build --vllm`")
        self._vllm = {"PDDLINK_ROLE_IMAGE": VLLM_IMAGE, "PDDLINK_MODEL_DIR": str(model_dir.resolve())}
        self._vllm |= {f"PDDLINK_CPUS_{role.upper()}": cores for role, cores in cpus.items()}
        self.run_dir = run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.run_dir, ROLE_UID, ROLE_UID)
        self._config_dir = config_dir.resolve()
        deadline = time.monotonic() + timeout_s
        sidecars = roles
        self._compose(["up", "-d", "--no-color", "--no-deps", "--force-recreate", *sidecars], timeout_s=120)
        self._wait_roles(sidecars, deadline)
        engines = [f"{role}-engine" for role in sidecars]
        self._compose(["--profile", "vllm", "up", "-d", "--no-color", "--no-deps", *engines], timeout_s=120)
        for role in sidecars:
            self._wait_http(f"http://{self.addr(role)}:{engine_port}/health", f"{role}-engine", deadline)

    def restart_router(self, timeout_s: float = 120.0) -> None:
        """The router container (re)started with the config directory's router.toml; waits until it serves."""
        (self.run_dir / "router.sock").unlink(missing_ok=True)
        (self.run_dir / "router.sock.grpc").unlink(missing_ok=True)
        self._compose(["up", "-d", "--no-color", "--no-deps", "--force-recreate", "router"], timeout_s=120)
        self._wait_roles(("router",), time.monotonic() + timeout_s)

    def _wait_http(self, url: str, service: str, deadline: float) -> None:
        while _http_status(url) != 200:
            if self._exited(service):
                raise LocalError(f"{service}'s container exited: {self._tail(service, 12)}")
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"{service} did not serve {url} in time: {self._tail(service)}")
            time.sleep(0.5)

    def undeploy(self) -> None:
        """Stop and remove the role containers (their logs are kept in the lab's ``logs/``)."""
        self.save_logs()
        self._compose(
            ["--profile", "vllm", "rm", "-s", "-f", "-v", *ROLES, *ENGINES], timeout_s=60, check=False
        )

    def down(self) -> dict[str, Any]:
        """Remove everything of this lab; stop the lab's own dockerd when no other lab is left."""
        return teardown(self.record.name, self.engine)

    # ---- where things are --------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.record.name

    def addr(self, role: str) -> str:
        return self.record.addr(role)

    def key(self, role: str) -> str:
        """The bearer key of ``role``'s HTTP port (router: its API; a sidecar: its admin port)."""
        return (self.record.directory / "keys" / role / KEY_FILE[role]).read_text().strip()

    def container(self, service: str) -> str:
        ids = self._compose(["ps", "-q", service], check=False).stdout.decode().split()
        if not ids:
            raise NotFound(f"service {service} of compose lab {self.name!r} has no container")
        return ids[0]

    def exec_argv(self, service: str, argv: list[str], detach: bool = False) -> list[str]:
        """``argv`` run inside ``service``'s container (as root there, with the container's capabilities)."""
        flags = ["-d"] if detach else []
        return [self.engine.tools.docker, "-H", f"unix://{self.engine.socket}", "exec", *flags,
                self.container(service), *argv]  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "project": self.record.project,
            "engine": {"socket": self.engine.socket, "own": self.engine.own},
            "dc-a": {"subnet": f"{self.record.net('dc-a')}.0/24", "bridge": self.record.bridge("dc-a")},
            "dc-b": {"subnet": f"{self.record.net('dc-b')}.0/24", "bridge": self.record.bridge("dc-b")},
            "addr": {role: self.addr(role) for role in ("relay", *ROLES)},
            "run_dir": str(self.run_dir),
        }

    def status(self) -> dict[str, Any]:
        """Containers and their states, the relay's view of the WAN."""
        ps = self.engine.docker(
            ["ps", "-a", "--filter", f"label=com.docker.compose.project={self.record.project}",
             "--format", "{{.Label \"com.docker.compose.service\"}} {{.State}}"],
            check=False,
        )  # fmt: skip
        containers = dict(line.split(" ", 1) for line in ps.stdout.decode().splitlines() if " " in line)
        try:
            wan: dict[str, Any] = control.request(self.control_path, {"op": "status"})
            wan.pop("ok", None)
        except (LocalError, InvalidInput) as exc:
            wan = {"error": str(exc)}
        return {**self.describe(), "containers": containers, "wan": wan}

    # ---- the WAN at run time -----------------------------------------------------------------
    @property
    def control_path(self) -> str:
        return str(self.record.directory / "control.sock")

    def set_outage(self, on: bool, direction: str = "both") -> None:
        op = {"op": "outage", "seconds": None} if on else {"op": "restore"}
        control.request(self.control_path, {**op, "direction": direction})

    def outage(self, seconds: float, direction: str = "both") -> None:
        if not seconds >= 0:
            raise InvalidInput(f"outage seconds {seconds!r} must be >= 0")
        control.request(
            self.control_path, {"op": "outage", "seconds": float(seconds), "direction": direction}
        )

    def set_profile(self, profile: Profile | str | os.PathLike[str]) -> None:
        source = _profile_source(profile)
        control.request(
            self.control_path, {"op": "profile", "toml": source.text, "name": source.profile.name}
        )

    def profile(self) -> Profile:
        return _profile_source(self.record.directory / "profile.toml").profile

    def measure_wan(self, pings: int = 200, iperf_s: int = 8) -> WanMeasurement:
        """RTT with ping and rate with iperf3 (TCP, BBR where the kernel has it, first 2 s omitted)
        from a probe container in dc-a to one in dc-b, across the relay like the roles' traffic; the
        probes are removed afterwards."""
        self._compose(["up", "-d", "--no-color", "--no-deps", *PROBES], timeout_s=60)
        try:
            return self._measure(self.addr("probe-b"), pings, iperf_s)
        finally:
            self._compose(["rm", "-s", "-f", "-v", *PROBES], timeout_s=60, check=False)

    def run_in_probe(
        self, argv: list[str], files: Path | None = None, timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` in a fresh probe-a container (dc-a: a client beside the router, MD across the
        relay) with ``files`` (a directory) copied to ``/probe`` first; the probe is removed after."""
        self._compose(["up", "-d", "--no-color", "--no-deps", "probe-a"], timeout_s=60)
        try:
            if files is not None:
                self.engine.docker(["cp", str(files), f"{self.container('probe-a')}:/probe"], timeout_s=60)
            return subprocess.run(
                self.exec_argv("probe-a", argv),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        finally:
            self._compose(["rm", "-s", "-f", "-v", "probe-a"], timeout_s=60, check=False)

    def _measure(self, far: str, pings: int, iperf_s: int) -> WanMeasurement:
        ping = ["ping", "-q", "-n", "-c", str(pings), "-i", "0.01", far]
        out = self._run(self.exec_argv("probe-a", ping), 60)
        rtt = re.search(r"= [\d.]+/([\d.]+)/", out)
        if rtt is None:
            raise LocalError(f"ping across the WAN gave no RTT: {out.strip()[-200:]}")
        self._run(self.exec_argv("probe-b", ["iperf3", "-s", "-1", "-p", "5299"], detach=True), 20)
        time.sleep(0.5)
        argv = ["iperf3", "-c", far, "-p", "5299", "-t", str(iperf_s + 2), "-O", "2", "-J"]
        if "bbr" in Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split():
            argv += ["-C", "bbr"]  # as the netlab check: the link's rate, not loss-driven backoff
        result = json.loads(self._run(self.exec_argv("probe-a", argv), iperf_s + 40))
        goodput = float(result["end"]["sum_received"]["bits_per_second"]) / 1e6
        mss = int(result["start"].get("tcp_mss_default") or 1448)
        prof = self.profile()
        return WanMeasurement(
            rtt_ms=float(rtt.group(1)),
            rtt_ms_profile=prof.rtt_ms,
            pings=pings,
            goodput_mbit=goodput,
            rate_mbit=goodput * (mss + 52) / mss,  # + IP (20) and TCP (20 + 12 timestamps) headers
            rate_mbit_profile=prof.a_to_b.rate_mbit or None,  # probe-a -> probe-b is a_to_b
        )

    # ---- internals ---------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        r = self.record
        return {
            "PDDLINK_LAB_DIR": str(r.directory),
            "PDDLINK_RUN_DIR": str(self.run_dir),
            "PDDLINK_CONFIG_DIR": str(getattr(self, "_config_dir", DEFAULT_CONFIG)),
            "PDDLINK_NET_A": r.net("dc-a"),
            "PDDLINK_NET_B": r.net("dc-b"),
            "PDDLINK_BRIDGE_A": r.bridge("dc-a"),
            "PDDLINK_BRIDGE_B": r.bridge("dc-b"),
            "PDDLINK_IMAGE": IMAGE,
            "PDDLINK_RELAY_RT": f"{self.engine.relay_rt_runtime_us}us",
            **getattr(self, "_vllm", {}),  # deploy_vllm: the roles' image, the model, the cores
        }

    def _compose(
        self, args: list[str], *, timeout_s: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        return self.engine.compose(
            self.record.project, COMPOSE_FILE, args, env=self._env(), timeout_s=timeout_s, check=check
        )

    def _run(self, argv: list[str], timeout_s: float) -> str:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise LocalError(
                f"{' '.join(argv[-3:])} in the lab: {(proc.stderr or proc.stdout).strip()[-300:]}"
            )
        return proc.stdout

    def _accept_bridged(self, on: bool) -> None:
        _bridge_rules(self.record, on)

    def _wait_relay(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ready = self.record.directory / "relay.ready"
        while not ready.exists():
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"the relay container was not ready in {timeout_s:.0f} s: {self._tail('relay')}"
                )
            if self._exited("relay"):
                raise LocalError(f"the relay container exited: {self._tail('relay')}")
            time.sleep(0.2)

    def _wait_roles(self, roles: tuple[str, ...], deadline: float) -> None:
        pending = set(roles)
        while pending:
            for role in sorted(pending):
                path = "/healthz" if role == "router" else "/readyz"
                sock = "router.sock" if role == "router" else f"{role}.admin.sock"
                if _unix_get(str(self.run_dir / sock), path) == 200:
                    pending.discard(role)
                elif self._exited(role):
                    raise LocalError(f"{role}'s container exited: {self._tail(role)}")
            if pending and time.monotonic() > deadline:
                raise DeadlineExceeded(f"{sorted(pending)} not ready in time")
            time.sleep(0.3)

    def _exited(self, service: str) -> bool:
        ids = self._compose(["--profile", "vllm", "ps", "-q", service], check=False).stdout.decode().split()
        if not ids:
            return False
        state = self.engine.docker(["inspect", "-f", "{{.State.Running}}", ids[0]], check=False)
        return state.stdout.decode().strip() == "false"

    def _tail(self, service: str, lines: int = 5) -> str:
        out = self._compose(
            ["--profile", "vllm", "logs", "--no-color", "--tail", str(lines), service], check=False
        )
        return " | ".join(out.stdout.decode(errors="replace").strip().splitlines()[-lines:])

    def save_logs(self) -> None:
        logs = self.record.directory / "logs"
        logs.mkdir(exist_ok=True)
        for service in ("relay", *ROLES, *(ENGINES if hasattr(self, "_vllm") else ())):  # (not the probes')
            out = self._compose(["--profile", "vllm", "logs", "--no-color", service], check=False)
            (logs / f"{service}.log").write_bytes(out.stdout)


def _make_directory(record: LabRecord, source: ProfileSource) -> None:
    from pddlink.serving.client_guard import write_key_file
    from pddlink.transport import PeerIdentity, load_or_create_pki
    from pddlink.transport.pki import node_dir

    d = record.directory
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps(asdict(record)))  # recorded before created
    (d / "profile.toml").write_text(source.text)
    (d / "profile.name").write_text(source.profile.name)
    identities = [PeerIdentity(role, IDENTITY[role]) for role in ROLES]
    load_or_create_pki(d / "pki" / "all", identities)
    for ident in identities:
        role_dir = d / "pki" / ident.role
        role_dir.mkdir()
        issued = node_dir(d / "pki" / "all", ident)  # the node's own directory: never the CA key
        for name in ("ca.pem", f"{ident.role}-{ident.name}.pem", f"{ident.role}-{ident.name}.key"):
            shutil.copy2(issued / name, role_dir / name)
            os.chown(role_dir / name, ROLE_UID, ROLE_UID)
        os.chown(role_dir, ROLE_UID, ROLE_UID)
    for role in ROLES:  # like the PKI: made here, never shipped
        key_dir = d / "keys" / role
        key_dir.mkdir(parents=True, mode=0o700)
        write_key_file(key_dir / KEY_FILE[role])
        os.chown(key_dir / KEY_FILE[role], ROLE_UID, ROLE_UID)
        os.chown(key_dir, ROLE_UID, ROLE_UID)
    (d / "run").mkdir()
    os.chown(d / "run", ROLE_UID, ROLE_UID)


def _bridge_rules(record: LabRecord, on: bool) -> None:
    """Accept frames that stay on one of the lab's bridges (see the module docstring)."""
    if shutil.which("iptables") is None:
        return
    for dc in ("dc-a", "dc-b"):
        rule = ["DOCKER-USER", "-i", record.bridge(dc), "-o", record.bridge(dc), "-j", "ACCEPT"]
        exists = subprocess.run(["iptables", "-C", *rule], capture_output=True, check=False).returncode == 0
        if on and not exists:
            subprocess.run(["iptables", "-I", *rule], capture_output=True, check=True, timeout=10)
        while not on and exists:
            subprocess.run(["iptables", "-D", *rule], capture_output=True, check=False, timeout=10)
            exists = (
                subprocess.run(["iptables", "-C", *rule], capture_output=True, check=False).returncode == 0
            )


def teardown(name: str, engine: Engine | None = None) -> dict[str, Any]:
    """Remove lab ``name``'s containers, networks, rules and directory (idempotent); stop the own
    dockerd when it was the last lab. Returns what was removed."""
    check_name(name)
    engine = engine or engines.running_engine()
    removed: dict[str, Any] = {"containers": 0, "networks": 0}
    with _labs_lock():
        record = next((r for r in _records() if r.name == name), None)
        if engine is not None:
            removed = _remove_project(engine, name)
        if record is not None:
            _bridge_rules(record, False)
            shutil.rmtree(record.directory, ignore_errors=True)
        last = not _records()
    if last and engine is not None and engine.own:
        removed["host_restored"] = engines.stop_engine()
        removed["engine_stopped"] = True
    return removed


def _remove_project(engine: Engine, name: str) -> dict[str, Any]:
    """Stop and remove the containers and networks labelled with lab ``name``'s compose project."""
    label = f"label=com.docker.compose.project=pddlink-{name}"
    ids = engine.docker(["ps", "-aq", "--filter", label], check=False).stdout.decode().split()
    if ids:
        engine.docker(["stop", "-t", "5", *ids], timeout_s=60, check=False)
        engine.docker(["rm", "-f", "-v", *ids], timeout_s=60, check=False)
    nets = engine.docker(["network", "ls", "-q", "--filter", label], check=False).stdout.decode().split()
    if nets:
        engine.docker(["network", "rm", *nets], timeout_s=60, check=False)
    return {"containers": len(ids), "networks": len(nets)}


def _http_status(url: str, timeout_s: float = 2.0) -> int:
    """The status of ``GET url`` (0: nothing answers)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def _unix_get(path: str, target: str, timeout_s: float = 2.0) -> int:
    """The status of ``GET target`` on the unix socket ``path`` (0: nothing answers)."""

    class _Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            self.sock.connect(path)

    if not os.path.exists(path):
        return 0
    conn = _Conn("localhost", timeout=timeout_s)
    try:
        conn.request("GET", target)
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()
