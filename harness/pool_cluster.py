"""A topology's pools as separate processes: one reference-engine sidecar per instance and one
router over them all (the pools demo, the pool tests).

    spec = PoolSpec(run_dir, topology=load_topology(path), placement="prefix_aware")
    with PoolCluster(spec, wan=LoopbackWan.up(topology)) as pools:
        channel = grpc.aio.insecure_channel(pools.router_target)      # the Router gRPC service
        pools.kill("md-b0"); pools.restart("md-b0")                    # a fault, for tests
        pools.terminate("md-b0", 40.0); pools.start_again("md-b0")     # a graceful restart

Every instance runs on 127.0.0.1 on fresh ports (the topology gives names, datacenters, links;
its addresses are replaced). ``run_dir/fleet.toml`` is the topology as the processes see it: P and
RLD read it for their peers (``[peers] topology``), the router for its pools. With a ``wan``
(``LoopbackWan``: one netlab loopback relay per WAN link, that link's rate and RTT), everything
that crosses a link reaches an MD through its link's relay; without one, directly. With ``tls``
each instance gets its own certificate (``<role>/<name>``) and every peer checks it.
``routers = N``: N routers over the same sidecars (``router``, ``router1``, ...; each its own
name, certificate, ports: ``router_url(process)``). ``etcd``: every sidecar and router gets a
``[membership]`` table (sidecars announce themselves, routers follow); ``add_sidecar`` starts one
the topology file does not name, which only etcd makes known.
``stop()`` (also on leaving the ``with`` block) ends every process.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

from harness.cluster import ClusterError, free_port, stop_processes
from pddlink.errors import DeadlineExceeded
from pddlink.roles import Role
from pddlink.topology import Engine, Instance, Member, Topology


class Wan(Protocol):
    def endpoint(self, datacenter: str, port: int) -> tuple[str, int]: ...


@dataclass(frozen=True, slots=True)
class PoolSpec:
    run_dir: Path
    topology: Topology
    placement: str = "prefix_aware"
    relay: bool = True
    dtype: str = "float64"
    preset: str = "tiny"
    md_num_blocks: int = 4096
    rld_capacity: int = 6
    slice_tokens: int = 8
    recompute: bool = False
    deadline_s: float = 30.0
    wan_links: int = 2  # P's WAN links toward each MD
    rld_token_budget: float = 1.0  # the routers' (``RouterConfig``; 1: none)
    tls: bool = True
    start_timeout_s: float = 180.0
    routers: int = 1  # replicas over the same topology: router0 (process "router"), router1, ...
    etcd: str = ""  # membership through etcd (every sidecar announces itself, routers follow); "" = off
    cluster: str = "pools"  # the membership keys' cluster name
    ttl_s: int = 3  # each sidecar's lease
    # role -> CPUs (``harness.cluster.datacenter_cpus``: MD instances on CPUs of their own, P, RLD
    # and the routers on the rest); () = anywhere
    cpus: tuple[tuple[str, str], ...] = ()
    api: tuple[str, ...] = ()  # more lines of the routers' [api] table (a tokenizer, a key file)


class PoolCluster:
    def __init__(self, spec: PoolSpec, wan: Wan | None = None) -> None:
        self.spec, self.wan = spec, wan
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        self.members = {m.name: m for m in spec.topology.members()}
        self.added: dict[str, Role] = {}  # sidecars started at run time (``add_sidecar``), by role
        self.ports = {name: (free_port(), free_port()) for name in self.members}  # (grpc, kv)
        if spec.routers < 1:
            raise ClusterError(f"routers: at least 1, got {spec.routers}")
        self.router_names = ["router"] + [f"router{k}" for k in range(1, spec.routers)]  # processes
        self.router_ports = {n: (free_port(), free_port()) for n in self.router_names}  # (grpc, http)
        self.router_port = self.router_ports["router"][0]
        self.router_unix = str(spec.run_dir / "router.sock")
        self.router_target = f"unix:{self.router_unix}.grpc"
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, IO[str]] = {}
        self.fleet_file = spec.run_dir / "fleet.toml"

    # -- files -----------------------------------------------------------------------------------

    def reached(self, m: Member, port: int) -> str:
        """Where P, RLD and the router (all beside P) reach ``m``'s ``port``."""
        if self.wan is not None and m.role is Role.MD:
            return "{}:{}".format(*self.wan.endpoint(m.datacenter, port))
        return f"127.0.0.1:{port}"

    def fleet(self) -> Topology:
        """The topology with the addresses the processes use."""
        dcs = []
        for dc in self.spec.topology.datacenters:
            pools = {}
            for role in (Role.P, Role.RLD, Role.MD):
                pools[role] = tuple(self._placed(Member(dc.name, inst)) for inst in dc.pool(role))
            dcs.append(dataclasses.replace(dc, p=pools[Role.P], rld=pools[Role.RLD], md=pools[Role.MD]))
        return Topology(tuple(dcs), self.spec.topology.links)

    def _placed(self, m: Member) -> Instance:
        grpc_port, kv_port = self.ports[m.name]
        kv = self.reached(m, kv_port) if m.role is not Role.P else ""
        address = self.reached(m, grpc_port)
        return dataclasses.replace(m.instance, address=address, kv_address=kv, admin_address="")

    def tls_dir(self, role: str, name: str) -> str:
        from pddlink.transport import PeerIdentity
        from pddlink.transport.pki import node_dir

        return str(node_dir(self.spec.run_dir / "pki", PeerIdentity(role, name))) if self.spec.tls else ""

    def router_url(self, process: str = "router") -> str:
        """A router's HTTP API (its OpenAI-style endpoints, /readyz, /status)."""
        return f"http://127.0.0.1:{self.router_ports[process][1]}"

    @staticmethod
    def router_identity(process: str) -> str:
        """``router`` runs as router0, ``routerK`` as itself (each its own certificate)."""
        return "router0" if process == "router" else process

    def admin_socket(self, name: str) -> str:
        return str(self.spec.run_dir / f"{name}.admin.sock")

    def _write_files(self) -> None:
        self.fleet_file.write_text(topology_toml(self.fleet()))
        s = self.spec
        for name, m in self.members.items():
            grpc_port, kv_port = self.ports[name]
            lines = [
                f'role = "{m.role.value}"',
                f'peer_id = "{name}"',
                'host = "127.0.0.1"',
                f"grpc_port = {grpc_port}",
                f'admin_unix = "{self.admin_socket(name)}"',
                f'tls_dir = "{self.tls_dir(m.role.value, name)}"',
            ]
            if m.role is not Role.P:
                lines.append(f"kv_port = {kv_port}")
            blocks = s.md_num_blocks if m.role is not Role.RLD else max(1024, s.md_num_blocks // 2)
            lines += ["[engine]", f'preset = "{s.preset}"', f'dtype = "{s.dtype}"', f"num_blocks = {blocks}"]
            if m.role is not Role.MD:
                lines += ["[peers]", f'topology = "{self.fleet_file}"']
            if m.role is Role.P:
                lines += ["[data_plane]", f"wan_links = {s.wan_links}"]
            if m.role is Role.RLD:
                lines += ["[decode]", f"capacity = {s.rld_capacity}", f"slice_tokens = {s.slice_tokens}"]
            lines += self._membership_lines(m.datacenter)
            (s.run_dir / f"{name}.toml").write_text("\n".join(lines) + "\n")
        for process in self.router_names:
            (s.run_dir / f"{process}.toml").write_text("\n".join(self._router_lines(process)) + "\n")

    def _membership_lines(self, datacenter: str = "") -> list[str]:
        s = self.spec
        if not s.etcd:
            return []
        lines = ["[membership]", f'etcd = "{s.etcd}"', f'cluster = "{s.cluster}"']
        if datacenter:  # a sidecar's
            lines += [f'datacenter = "{datacenter}"', f"ttl_s = {s.ttl_s}"]
        return lines

    def add_sidecar(self, name: str, role: Role, datacenter: str) -> None:
        """Start a sidecar the topology file does not name: it announces itself through etcd
        (``etcd`` must be set) in ``datacenter``, with a certificate of the deployment's CA."""
        if not self.spec.etcd:
            raise ClusterError("add_sidecar: membership through etcd is off (PoolSpec.etcd)")
        if self.spec.tls:
            from pddlink.transport import PeerIdentity, load_or_create_pki

            load_or_create_pki(self.spec.run_dir / "pki", [PeerIdentity(role.value, name)])
        grpc_port, kv_port = self.ports[name] = (free_port(), free_port())
        s = self.spec
        lines = [
            f'role = "{role.value}"',
            f'peer_id = "{name}"',
            'host = "127.0.0.1"',
            f"grpc_port = {grpc_port}",
            f'admin_unix = "{self.admin_socket(name)}"',
            f'tls_dir = "{self.tls_dir(role.value, name)}"',
        ]
        if role is not Role.P:
            lines.append(f"kv_port = {kv_port}")
        lines += [
            "[engine]",
            f'preset = "{s.preset}"',
            f'dtype = "{s.dtype}"',
            f"num_blocks = {s.md_num_blocks}",
        ]
        lines += self._membership_lines(datacenter)
        (s.run_dir / f"{name}.toml").write_text("\n".join(lines) + "\n")
        self.added[name] = role
        self._launch(name)
        self._wait_ready([name])

    def _router_lines(self, process: str) -> list[str]:
        s = self.spec
        grpc_port, http_port = self.router_ports[process]
        unix = self.router_unix if process == "router" else str(s.run_dir / f"{process}.sock")
        ident = self.router_identity(process)
        return [
            f'topology = "{self.fleet_file}"',
            f'placement = "{s.placement}"',
            'host = "127.0.0.1"',
            f"grpc_port = {grpc_port}",
            f"http_port = {http_port}",
            f'unix = "{unix}"',
            f'name = "{ident}"',
            f'tls_dir = "{self.tls_dir("router", ident)}"',
            f"rld_capacity = {s.rld_capacity}",
            f"deadline_s = {s.deadline_s}",
            f"relay_enabled = {'true' if s.relay else 'false'}",
            f"recompute = {'true' if s.recompute else 'false'}",
            "admission = false",
            f"wan_links = {s.wan_links}",
            *([f"rld_token_budget = {s.rld_token_budget}"] if s.rld_token_budget < 1 else []),
            *self._membership_lines(),
            # every client is 127.0.0.1 here (the demo's, or the load balancer in front)
            "[api]",
            "max_connections_per_client = 512",
            "rate_per_client_s = 0.0",
            *s.api,
        ]

    # -- processes -------------------------------------------------------------------------------

    def _launch(self, name: str) -> None:
        """Start (or start again) ``name``: a router, a sidecar of the topology or one added at run
        time (``add_sidecar``: the topology's members do not list it)."""
        log = open(self.spec.run_dir / f"{name}.log", "a")  # noqa: SIM115 (closed in stop())
        self.logs[name] = log
        what = "router" if name in self.router_names else "sidecar"
        config = str(self.spec.run_dir / f"{name}.toml")
        argv = [sys.executable, "-m", "pddlink.cli.main", what, "--config", config]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        role = None if what == "router" else (self.added.get(name) or self.members[name].role)
        cpus = dict(self.spec.cpus).get("router" if role is None else role.value)
        argv = ["taskset", "-c", cpus, *argv] if cpus else argv
        self.procs[name] = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True
        )

    def _wait_ready(self, names: list[str]) -> None:
        from harness.cluster import Cluster

        waiter = Cluster.__new__(Cluster)  # its READY reader, over our processes
        waiter.procs, waiter.spec = self.procs, self.spec  # type: ignore[assignment]
        try:
            Cluster._wait_ready(waiter, tuple(names), self.spec.start_timeout_s)
        except (ClusterError, DeadlineExceeded) as exc:
            raise ClusterError(f"{exc} (logs in {self.spec.run_dir})") from None

    def start(self) -> PoolCluster:
        ids = [(m.role.value, name) for name, m in self.members.items()]
        ids += [("router", self.router_identity(n)) for n in self.router_names]
        if self.spec.tls:
            from pddlink.transport import PeerIdentity, load_or_create_pki

            load_or_create_pki(self.spec.run_dir / "pki", [PeerIdentity(r, n) for r, n in ids])
        from pddlink.serving.rpc import engine_stubs, stubs

        stubs()
        engine_stubs()
        self._write_files()
        decoders = [n for n, m in self.members.items() if m.role is not Role.P]
        for name in decoders:
            self._launch(name)
        self._wait_ready(decoders)
        prefill = [n for n, m in self.members.items() if m.role is Role.P]
        for name in prefill:
            self._launch(name)
        self._wait_ready(prefill)
        for process in self.router_names:
            self._launch(process)
        self._wait_ready(self.router_names)
        return self

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def restart(self, name: str) -> None:
        self.kill(name)
        self.start_again(name)

    def terminate(self, name: str, timeout_s: float) -> int | None:
        """SIGTERM to ``name`` (a graceful stop: a router finishes its streams, a sidecar drains);
        its exit status, or None when it was still there after ``timeout_s`` and was killed."""
        proc = self.procs[name]
        if proc.poll() is not None:
            return proc.returncode
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(name)
            return None

    def start_again(self, name: str) -> None:
        """``name`` (stopped) starts again with its file, on its ports; returns once it is READY."""
        old = self.logs.pop(name, None)
        if old is not None:
            old.close()
        self._launch(name)
        self._wait_ready([name])

    def stop(self, timeout_s: float = 8.0) -> None:
        stop_processes(self.procs, self.logs, timeout_s)

    def __enter__(self) -> PoolCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def topology_toml(topo: Topology) -> str:
    """``topo`` as the TOML ``pddlink.topology.load_topology`` reads."""
    out = ["[topology]", ""]
    for dc in topo.datacenters:
        out += ["[[topology.datacenter]]", f'name = "{dc.name}"', ""]
        for role in (Role.P, Role.RLD, Role.MD):
            for inst in dc.pool(role):
                out += [f"[[topology.datacenter.{role.value}]]", f'name = "{inst.name}"']
                fields: dict[str, Any] = {
                    "address": inst.address,
                    "identity": inst.identity,
                    "kv": inst.kv_address,
                    "admin": inst.admin_address,
                    "engine": inst.engine.value if inst.engine is not Engine.REFERENCE else "",
                    "api_url": inst.api_url,
                    "kv_events": inst.kv_events,
                }
                out += [f'{k} = "{v}"' for k, v in fields.items() if v]
                out.append("")
    for link in topo.links:
        out += [
            "[[topology.link]]",
            f'between = ["{link.a}", "{link.b}"]',
            f"line_mbit = {link.line_mbit}",
            f"rtt_ms = {link.rtt_ms}",
            "",
        ]
    return "\n".join(out)
