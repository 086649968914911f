"""vLLM pools on one machine: a topology's P, RLD and MD instances as vLLM servers, each beside its
pddlink vLLM sidecar, described by one topology file that the router and every P's sidecar read
(issue 26 with ``engine = "vllm"``).

``VllmPool(PoolSpec(workdir, model, mds=2)).start()``: the shape is ``spec.topology`` (its
datacenters, pools, names and links; its addresses are replaced), or without one a P in "dc-a" and
``mds`` MDs in "dc-b" over one link. ``start()`` runs each MD's and RLD's sidecar (its KV port, its
vLLM's KV-event endpoint), writes the topology as the processes see it (``pool.topology_path``:
every instance's ``api_url``, each MD's and RLD's ``kv``, each MD's ``kv_events``), then each P's
sidecar with ``[peers] topology`` (a peer per MD and RLD, by name), then every vLLM server at once,
and waits until each serves. The router takes ``pool.topology`` (``RouterConfig(engine="vllm",
topology=...)``).

With ``spec.wan`` (``harness.demo_pools.LoopbackWan``: a netlab loopback relay per WAN link, at the
link's rate and RTT) everything P and the router send to an MD, its KV and its HTTP calls, crosses
that MD's link; RLD is beside P (loopback, the fast path). Without one, all of it is loopback.
``pin_cores``: P's servers on one half of the cores, RLD's and MD's on the other
(``harness.vllm.pair.engine_cores``). ``close()`` stops the servers, then the sidecars.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.pool_cluster import Wan, topology_toml
from harness.vllm.pair import engine_cores, free_port
from harness.vllm.server import VllmServer, VllmServerSpec
from harness.vllm.sidecar_proc import SidecarProcess, sidecar_toml
from pddlink.roles import Role
from pddlink.topology import Datacenter, Engine, Instance, Member, Topology, WanLink, load_topology


@dataclass(frozen=True, slots=True)
class PoolSpec:
    workdir: Path
    model: Path
    mds: int = 2  # without a topology: one P in dc-a, this many MDs in dc-b
    topology: Topology | None = None  # the shape (datacenters, pools, names, links); addresses replaced
    wan: Wan | None = None  # an MD's ports as P and the router reach them (None: loopback)
    model_id: str = "tiny-llama"
    dtype: str = "float32"
    block_size: int = 32
    extra_args: tuple[str, ...] = ()  # every server's extra vLLM arguments
    line_mbit: float = 400.0  # the default shape's link (the router's link model)
    rtt_ms: float = 10.0
    sidecar_start_s: float = 240.0
    pin_cores: bool = False
    wan_line_mbit: float = 0.0  # P's codec choice (0: measured)

    def shape(self) -> Topology:
        if self.topology is not None:
            return self.topology

        def one(role: Role, name: str, k: int) -> Instance:  # its api_url is replaced when placed
            return Instance(role, name, engine=Engine.VLLM, api_url=f"http://127.0.0.1:{k}")

        a = Datacenter("dc-a", p=(one(Role.P, "p-a0", 1),))
        mds = tuple(one(Role.MD, f"md-b{i}", i + 2) for i in range(self.mds))
        link = WanLink("dc-a", "dc-b", self.line_mbit, self.rtt_ms)
        return Topology((a, Datacenter("dc-b", md=mds)), (link,))


class VllmPool:
    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.members = {m.name: m for m in spec.shape().members()}
        self.md_names = [n for n, m in self.members.items() if m.role is Role.MD]
        self.p_names = [n for n, m in self.members.items() if m.role is Role.P]
        self.sides: dict[str, SidecarProcess] = {}  # by instance name
        self.servers: dict[str, VllmServer] = {}
        self.topology_path = spec.workdir / "fleet.toml"
        self.cores: dict[str, tuple[int, ...]] = {}

    @property
    def topology(self) -> Topology:
        return load_topology(self.topology_path)

    @property
    def p(self) -> VllmServer:
        """The first P's server."""
        return self.servers[self.p_names[0]]

    def start(self, timeout_s: float = 300.0) -> VllmPool:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.close()
            raise

    def _side(self, role: str, name: str, **keys: Any) -> SidecarProcess:
        s = self.spec
        text = sidecar_toml(role, name, s.workdir, s.model_id, s.block_size, **keys)
        side = self.sides[name] = SidecarProcess(s.workdir, name, text)
        return side.start(s.sidecar_start_s)

    def _reached(self, m: Member, port: int) -> str:
        """Where P and the router reach ``m``'s ``port``: across its link for an MD."""
        if self.spec.wan is not None and m.role is Role.MD:
            return "{}:{}".format(*self.spec.wan.endpoint(m.datacenter, port))
        return f"127.0.0.1:{port}"

    def _start(self, timeout_s: float) -> VllmPool:
        s = self.spec
        s.workdir.mkdir(parents=True, exist_ok=True)
        decoders = [n for n, m in self.members.items() if m.role is not Role.P]
        events = {name: f"ipc://{s.workdir / f'{name}-events.ipc'}" for name in decoders}
        for name in decoders:
            self._side(self.members[name].role.value, name, kv_events_endpoint=events[name])
        ports = {name: free_port() for name in self.members}
        self.topology_path.write_text(topology_toml(self._placed(ports, events)))
        for name in self.p_names:
            self._side("p", name, topology=str(self.topology_path), wan_line_mbit=s.wan_line_mbit)
        base = VllmServerSpec(
            s.model,
            0,
            dtype=s.dtype,
            block_size=s.block_size,
            extra_args=("--enable-prompt-tokens-details", *s.extra_args),
        )
        self.cores = engine_cores() if s.pin_cores else {}
        for name, port in ports.items():
            role = self.members[name].role
            spec = replace(
                base,
                port=port,
                control_socket=self.sides[name].control_path,
                kv_role="kv_producer" if role is Role.P else "kv_consumer",
                kv_events_endpoint=events.get(name, ""),
                cpus=self.cores.get(role.value, ()),
            )
            self.servers[name] = VllmServer(spec, s.workdir / f"{name}-vllm.log").start()
        for server in self.servers.values():
            server.wait_ready(timeout_s)
        return self

    def _placed(self, ports: dict[str, int], events: dict[str, str]) -> Topology:
        """The shape with the addresses the processes use."""
        shape = self.spec.shape()
        dcs = []
        for dc in shape.datacenters:
            pools = {}
            for role in (Role.P, Role.RLD, Role.MD):
                placed = []
                for inst in dc.pool(role):
                    m = Member(dc.name, inst)
                    kv = self._reached(m, self.sides[inst.name].kv_port) if role is not Role.P else ""
                    url = "http://" + self._reached(m, ports[inst.name])
                    placed.append(
                        dataclasses.replace(
                            inst,
                            engine=Engine.VLLM,
                            address="",
                            admin_address="",
                            api_url=url,
                            kv_address=kv,
                            kv_events=events[inst.name] if role is Role.MD else "",
                        )
                    )
                pools[role] = tuple(placed)
            dcs.append(dataclasses.replace(dc, p=pools[Role.P], rld=pools[Role.RLD], md=pools[Role.MD]))
        return Topology(tuple(dcs), shape.links)

    def transfers(self, name: str) -> dict[str, Any]:
        """``name``'s sidecar's ``/transfers`` (P: ``done``; an MD: ``finished``, ``in_flight``)."""
        return self.sides[name].transfers()

    def status(self) -> dict[str, Any]:
        return {name: side.status() for name, side in self.sides.items()}

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        for side in self.sides.values():
            side.close()
