"""A P / RLD / MD / router deployment as separate processes across a netlab WAN (demo and e2e tests).

    with Lab.up(profile, name=...) as lab, Cluster(lab, ClusterSpec(run_dir, relay=True)) as cluster:
        channel = grpc.aio.insecure_channel(cluster.router_target)   # the Router gRPC service
        ...
        cluster.kill("rld")                                          # a fault, for tests

P, RLD and the router run in datacenter A, MD in datacenter B (network namespaces as root,
loopback relays otherwise). The router also listens on a unix socket, so a client outside the
namespaces (the demo itself) reaches it; each sidecar serves its admin HTTP on a unix socket in
``run_dir``. ``stop()`` (also on leaving the ``with`` block) sends SIGTERM, waits, then SIGKILL: no
process outlives the cluster.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from netlab.lab import Lab
from pddlink.errors import DeadlineExceeded, LocalError
from pddlink.roles import Role

ROLES = (Role.MD, Role.RLD, Role.P, Role.ROUTER)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    run_dir: Path
    relay: bool = True
    line_mbit: float = 16.0
    rtt_ms: float = 20.0
    dtype: str = "float64"
    preset: str = "tiny"
    slice_tokens: int = 8
    rld_capacity: int = 6
    rld_tpot_s: float = 0.02
    relay_min_wan_s: float = 0.15
    recompute: bool = False  # the router may let MD prefill the missing suffix itself
    admission: bool = False  # the router rejects what no option ends before its deadline
    md_tpot_s: float = 0.0  # the router's starting figure for MD's time per token (0: its default)
    slo_ttft_ms: float = 0.0  # the router's SLO (``RouterConfig.slo_ttft_ms``; 0: none)
    slo_tpot_ms: float = 0.0  # its decode-speed bound (``RouterConfig.slo_tpot_ms``; 0: none)
    rld_token_budget: float = 1.0  # RLD's share of the output tokens (``RouterConfig``; 1: no budget)
    deadline_s: float = 30.0
    tls: bool = True
    start_timeout_s: float = 120.0
    engine_mode: str = "thread"  # "process": each sidecar runs its engine as a child over the engine link
    # role -> the CPUs its process (and every thread and child of it) may run on, as ``taskset -c``
    # takes them ("1", "0-2"); a role not named runs anywhere. Each datacenter owns its chips: on one
    # machine, MD decoding beside P's prefill otherwise pays for it (see ``datacenter_cpus``)
    cpus: tuple[tuple[str, str], ...] = ()
    md_prefill_slowdown: float = 1.0  # MD's engine prefills this many times slower (a decode-leaning chip)


def datacenter_cpus(cpus: list[int] | None = None) -> tuple[tuple[str, str], ...]:
    """``ClusterSpec.cpus`` giving MD's datacenter its own CPUs: the last third of the CPUs this
    process may use (at least one), P, RLD and the router the rest. Without it, on a small machine
    every prefill P runs stalls MD's decode steps, a cost two datacenters never share, and MD's time
    per token measures P's load as much as MD's own. One CPU: no pinning."""
    have = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(have) < 2:
        return ()
    md = max(1, len(have) // 3)
    mine, rest = ",".join(map(str, have[-md:])), ",".join(map(str, have[:-md]))
    return (("md", mine), ("p", rest), ("rld", rest), ("router", rest))


def cpu_set(cpus: str) -> frozenset[int]:
    """A CPU list as ``taskset -c`` and the kernel's ``Cpus_allowed_list`` write it ("0,2-3")."""
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def allowed_cpus(pid: int) -> frozenset[int]:
    """The CPUs process ``pid`` may run on (its main thread's ``Cpus_allowed_list``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return cpu_set(line.split(":", 1)[1])
    raise ClusterError(f"no Cpus_allowed_list for process {pid}")


_ISSUED: collections.deque[int] = collections.deque(maxlen=4096)  # ports free_port handed out lately


def free_port() -> int:
    """A TCP port free on loopback now and not handed out by this process lately, below the kernel's
    ephemeral range where it can (``FREE_PORTS``). The kernel may hand the same port to two
    ``bind(0)`` calls once the first socket is closed, and a port free on the host says nothing of a
    netlab namespace where an earlier cluster's process may still hold it: CI saw an RLD fail to
    bind 198.18.1.1:50445 ("Address already in use"). A port from the ephemeral range may also become
    some connection's source port before its server binds it: CI saw an RLD fail to bind
    127.0.0.1:41425 while the cluster's other processes connected to each other."""
    low, _ = _ephemeral_range()
    top = min(FREE_PORTS[1], low - 1)
    for _ in range(200 if top > FREE_PORTS[0] else 0):
        port = random.randint(FREE_PORTS[0], top)
        if port not in _ISSUED and _bindable(port):
            _ISSUED.append(port)
            return port
    while True:  # no room below the ephemeral range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _ISSUED:
            _ISSUED.append(port)
            return port


FREE_PORTS = (20000, 32767)  # where ``free_port`` looks first (Linux's ephemeral range starts at 32768)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ``bind(0)`` and outgoing connections' source ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class NoWan:
    """Stands in for a netlab ``Lab`` where a test needs processes but no WAN between them: every
    role on 127.0.0.1, peers reached directly. (Tests of the sidecar itself; the demo and the e2e
    tests use a real lab.)"""

    mode = "direct"

    def addr(self, dc: str) -> str:
        return "127.0.0.1"

    def endpoint(self, dc: str, port: int, proto: str = "tcp") -> tuple[str, int]:
        return "127.0.0.1", port

    def popen(self, dc: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, **kwargs)


class ClusterError(LocalError):
    """A process of the deployment failed to start or died."""


class Cluster:
    def __init__(self, lab: Lab | NoWan, spec: ClusterSpec) -> None:
        self.lab, self.spec = lab, spec
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, IO[str]] = {}
        self.ports = {k: free_port() for k in ("md_grpc", "md_kv", "rld_grpc", "rld_kv", "p_grpc", "router")}
        self.router_unix = str(spec.run_dir / "router.sock")
        self.router_target = f"unix:{self.router_unix}.grpc"

    @property
    def pki_dir(self) -> Path:
        """The deployment's dev PKI when ``spec.tls``: the CA in ``pki/ca`` (no process reads it) and
        one node directory per process (``pddlink.transport.pki.load_or_create_pki``)."""
        return self.spec.run_dir / "pki"

    def tls_dir(self, role: str) -> str:
        """``role``'s --tls-dir: its own key and certificate and ca.pem; "" (plaintext) without TLS."""
        from pddlink.transport import PeerIdentity
        from pddlink.transport.pki import node_dir

        return str(node_dir(self.pki_dir, PeerIdentity(role, f"{role}0"))) if self.spec.tls else ""

    def admin_socket(self, role: str) -> str:
        return str(self.spec.run_dir / f"{role}.admin.sock")

    # -- processes -------------------------------------------------------------------------------

    def _argv(self, role: str) -> list[str]:
        s, p, lab = self.spec, self.ports, self.lab
        a, b = lab.addr("dc-a"), lab.addr("dc-b")
        md_grpc = "{}:{}".format(*lab.endpoint("dc-b", p["md_grpc"]))
        md_kv = "{}:{}".format(*lab.endpoint("dc-b", p["md_kv"]))
        base = [sys.executable, "-m", "pddlink.cli.main"]
        common = ["--dtype", s.dtype, "--preset", s.preset, "--admin-unix", self.admin_socket(role)]
        common += ["--engine-mode", s.engine_mode]
        common += ["--tls-dir", self.tls_dir(role)]  # "": plaintext, said explicitly
        if not s.tls:  # namespace addresses are not loopback: plaintext there is an explicit choice
            common.append("--allow-plaintext-non-loopback")
        if role == "md":
            return [
                *base,
                "sidecar",
                "--role",
                "md",
                "--host",
                b,
                "--grpc-port",
                str(p["md_grpc"]),
                "--kv-port",
                str(p["md_kv"]),
                "--num-blocks",
                "4096",
                *(["--prefill-slowdown", str(s.md_prefill_slowdown)] if s.md_prefill_slowdown > 1 else []),
                *common,
            ]
        if role == "rld":
            return [
                *base,
                "sidecar",
                "--role",
                "rld",
                "--host",
                a,
                "--grpc-port",
                str(p["rld_grpc"]),
                "--kv-port",
                str(p["rld_kv"]),
                "--md-grpc",
                md_grpc,
                "--num-blocks",
                "2048",
                "--capacity",
                str(s.rld_capacity),
                "--slice-tokens",
                str(s.slice_tokens),
                *common,
            ]
        if role == "p":
            return [
                *base,
                "sidecar",
                "--role",
                "p",
                "--host",
                a,
                "--grpc-port",
                str(p["p_grpc"]),
                "--md-grpc",
                md_grpc,
                "--md-kv",
                md_kv,
                "--rld-grpc",
                f"{a}:{p['rld_grpc']}",
                "--rld-kv",
                f"{a}:{p['rld_kv']}",
                "--num-blocks",
                "4096",
                "--wan-line-mbit",
                str(s.line_mbit),
                *common,
            ]
        argv = [
            *base,
            "router",
            "--p",
            f"{a}:{p['p_grpc']}",
            "--rld",
            f"{a}:{p['rld_grpc']}",
            "--md",
            md_grpc,
            "--host",
            a,
            "--grpc-port",
            str(p["router"]),
            "--unix",
            self.router_unix,
            "--line-mbit",
            str(s.line_mbit),
            "--rtt-ms",
            str(s.rtt_ms),
            "--rld-capacity",
            str(s.rld_capacity),
            "--rld-tpot-s",
            str(s.rld_tpot_s),
            "--relay-min-wan-s",
            str(s.relay_min_wan_s),
            "--deadline-s",
            str(s.deadline_s),
            "--tls-dir",
            self.tls_dir("router"),
            "--recompute" if s.recompute else "--no-recompute",
            "--admission" if s.admission else "--no-admission",
        ]
        if not s.tls:
            argv.append("--allow-plaintext-non-loopback")
        optional = (
            ("--md-tpot-s", s.md_tpot_s),
            ("--slo-ttft-ms", s.slo_ttft_ms),
            ("--slo-tpot-ms", s.slo_tpot_ms),
            ("--rld-token-budget", s.rld_token_budget if s.rld_token_budget < 1 else 0.0),
        )
        for flag, value in optional:
            argv += [flag, str(value)] if value else []
        return [*argv, "--no-relay"] if not s.relay else argv

    def _launch(self, role: str) -> None:
        dc = "dc-b" if role == "md" else "dc-a"
        log = open(self.spec.run_dir / f"{role}.log", "a")  # noqa: SIM115 (closed in stop())
        self.logs[role] = log
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cpus = dict(self.spec.cpus).get(role)
        self.procs[role] = self.lab.popen(
            dc,
            ["taskset", "-c", cpus, *self._argv(role)] if cpus else self._argv(role),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            start_new_session=True,
        )

    def _wait_ready(self, roles: tuple[str, ...], timeout_s: float) -> None:
        ready: dict[str, Any] = {}

        def reader(role: str) -> None:
            proc = self.procs[role]
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("READY "):
                    ready[role] = json.loads(line[6:])
                    break
            # keep draining so the child never blocks on a full pipe
            for _ in proc.stdout:
                pass

        for role in roles:
            threading.Thread(target=reader, args=(role,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(r in ready for r in roles):
                return
            for role in roles:
                if self.procs[role].poll() is not None:
                    raise ClusterError(
                        f"{role} exited with {self.procs[role].returncode}; see {self.log_tail(role)}"
                    )
            time.sleep(0.05)
        raise DeadlineExceeded(f"{[r for r in roles if r not in ready]} not ready after {timeout_s:.0f} s")

    def log_tail(self, role: str, lines: int = 5) -> str:
        path = self.spec.run_dir / f"{role}.log"
        with contextlib.suppress(OSError):
            return " | ".join(path.read_text().splitlines()[-lines:])
        return str(path)

    def start(self) -> Cluster:
        if self.spec.tls:
            from pddlink.transport import PeerIdentity, load_or_create_pki

            load_or_create_pki(self.pki_dir, [PeerIdentity(r, f"{r}0") for r in ROLES])
        from pddlink.serving.rpc import engine_stubs, stubs

        stubs()  # generate once, before four processes would race to
        engine_stubs()
        for role in ("md", "rld", "p"):
            self._launch(role)
        self._wait_ready(("md", "rld", "p"), self.spec.start_timeout_s)
        self._launch("router")
        self._wait_ready(("router",), self.spec.start_timeout_s)
        return self

    def kill(self, role: str) -> None:
        proc = self.procs.get(role)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def restart(self, role: str) -> None:
        """Start ``role`` again on its ports (killing it first if it still runs): what a supervisor
        does after a crash (the chaos suite)."""
        self.kill(role)
        old = self.logs.pop(role, None)
        if old is not None:
            old.close()
        self._launch(role)
        self._wait_ready((role,), self.spec.start_timeout_s)

    def pids(self, role: str) -> list[int]:
        """The role's process and its children (an engine process), for RSS sampling."""
        proc = self.procs.get(role)
        if proc is None or proc.poll() is not None:
            return []
        out = [proc.pid]
        with contextlib.suppress(OSError):
            out += [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        return out

    def stop(self, timeout_s: float = 8.0) -> None:
        stop_processes(self.procs, self.logs, timeout_s)

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def stop_processes(procs: dict[str, Any], logs: dict[str, Any], timeout_s: float = 8.0) -> None:
    """SIGTERM to each process group, SIGKILL to those still there after ``timeout_s`` in all;
    then the logs are closed and ``procs`` emptied (the clusters' ``stop``)."""
    for proc in procs.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs.values():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    for log in logs.values():
        log.close()
    procs.clear()
