"""vLLM pools on one machine: one P and several MDs as vLLM servers, each beside its pddlink vLLM
sidecar, described by a topology file that the router and P's sidecar both read (issue 26 with
``engine = "vllm"``).

``VllmPool(PoolSpec(workdir, model, mds=2)).start()``: each MD's sidecar (its KV port, its vLLM's
KV-event endpoint), then the topology (``pool.topology_path``: P in "dc-a", the MDs in "dc-b", one
link; every instance's ``api_url``, each MD's ``kv`` and ``kv_events``), then P's sidecar with
``[peers] topology`` (a peer per MD, by name), then the vLLM servers, all at once, and waits until
each serves. The router takes ``pool.topology`` (``RouterConfig(engine="vllm", topology=...)``).
P's sidecar dials each MD's KV port on loopback (no emulated WAN). ``close()`` stops the servers,
then the sidecars.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.vllm.pair import free_port
from harness.vllm.server import VllmServer, VllmServerSpec
from harness.vllm.sidecar_proc import SidecarProcess, sidecar_toml
from pddlink.topology import Topology, load_topology


@dataclass(frozen=True, slots=True)
class PoolSpec:
    workdir: Path
    model: Path
    mds: int = 2
    model_id: str = "tiny-llama"
    dtype: str = "float32"
    block_size: int = 32
    extra_args: tuple[str, ...] = ()  # every server's extra vLLM arguments
    line_mbit: float = 400.0  # the topology's link (the router's link model; the KV stays on loopback)
    rtt_ms: float = 10.0
    sidecar_start_s: float = 240.0


class VllmPool:
    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.md_names = [f"md-b{i}" for i in range(spec.mds)]
        self.sides: dict[str, SidecarProcess] = {}  # by instance name
        self.servers: dict[str, VllmServer] = {}
        self.topology_path = spec.workdir / "fleet.toml"

    @property
    def topology(self) -> Topology:
        return load_topology(self.topology_path)

    @property
    def p(self) -> VllmServer:
        return self.servers["p-a0"]

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

    def _start(self, timeout_s: float) -> VllmPool:
        s = self.spec
        s.workdir.mkdir(parents=True, exist_ok=True)
        events = {name: f"ipc://{s.workdir / f'{name}-events.ipc'}" for name in self.md_names}
        for name in self.md_names:
            self._side("md", name, kv_events_endpoint=events[name])
        ports = {name: free_port() for name in ("p-a0", *self.md_names)}
        self.topology_path.write_text(self._topology_text(ports, events))
        self._side("p", "p-a0", topology=str(self.topology_path))
        base = VllmServerSpec(
            s.model,
            0,
            dtype=s.dtype,
            block_size=s.block_size,
            extra_args=("--enable-prompt-tokens-details", *s.extra_args),
        )
        for name, port in ports.items():
            side = self.sides[name]
            spec = replace(base, port=port, control_socket=side.control_path, kv_role="kv_producer")
            if name != "p-a0":
                spec = replace(spec, kv_role="kv_consumer", kv_events_endpoint=events[name])
            self.servers[name] = VllmServer(spec, s.workdir / f"{name}-vllm.log").start()
        for server in self.servers.values():
            server.wait_ready(timeout_s)
        return self

    def _topology_text(self, ports: dict[str, int], events: dict[str, str]) -> str:
        s = self.spec
        lines = [
            '[topology]\nengine = "vllm"\n',
            '[[topology.datacenter]]\nname = "dc-a"',
            f'[[topology.datacenter.p]]\nname = "p-a0"\napi_url = "http://127.0.0.1:{ports["p-a0"]}"\n',
            '[[topology.datacenter]]\nname = "dc-b"',
        ]
        for name in self.md_names:
            lines.append(
                f'[[topology.datacenter.md]]\nname = "{name}"\napi_url = "http://127.0.0.1:{ports[name]}"\n'
                f'kv = "127.0.0.1:{self.sides[name].kv_port}"\nkv_events = "{events[name]}"\n'
            )
        lines.append(
            f'[[topology.link]]\nbetween = ["dc-a", "dc-b"]\nline_mbit = {s.line_mbit}\nrtt_ms = {s.rtt_ms}\n'
        )
        return "\n".join(lines)

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
