"""P and MD (and, with ``relay=True``, RelayDecode) as vLLM servers, each beside its pddlink
sidecar: what the tests, the demo and the bench start.

``VllmPair(workdir, model, ...)``: ``start()`` runs each sidecar as users do, ``pddlink sidecar
--config F`` with ``engine = "vllm"`` in a process of its own (``harness.vllm.sidecar_proc``), then
the vLLM servers (child processes) with ``PddlinkConnector`` pointed at their sidecar's control
socket; MD's vLLM publishes KV-cache events
to MD's sidecar. ``md_addr`` lets the WAN run through netlab (P's sidecar dials that address, which
forwards to MD's KV port). ``close()`` stops the servers, then the sidecars.

``PairSpec(relay=True)`` (or ``VllmTrio``) adds RelayDecode in datacenter A: a consumer sidecar
whose KV port P's sidecar dials directly on loopback (the fast path, never through the WAN; its
transport is ``rld_transport``: "auto" = RDMA where a device is, else TCP) and a vLLM server with
the connector as ``kv_consumer``. One prefill on P then ships to both, each the suffix its DRC lacks
(RLD's and MD's sidecars each follow their own vLLM's KV-cache events). ``status()`` has a key per
sidecar: "p", "md" and "rld".

``servers()`` names the vLLM servers by role; ``restart(role)`` kills one with ``kill -9``, starts
it again on the same port and arguments beside the same sidecar, and waits until it serves (the
chaos suite's engine restart, as a supervisor would do it).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.vllm.server import VllmServer, VllmServerSpec
from harness.vllm.sidecar_proc import SidecarProcess, sidecar_toml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class PairSpec:
    workdir: Path
    model: Path
    model_id: str = "tiny-llama"
    dtype: str = "float32"
    block_size: int = 32
    md_num_blocks: int = 0  # >0: a small MD cache that evicts
    md_addr: str = ""  # where P's sidecar dials MD ("" = MD's KV port on loopback)
    wan: Callable[[int], str] | None = None  # MD's KV port -> the address across the WAN (netlab)
    md_kv_port: int = 0
    kv_load_failure_policy: str = "fail"
    extra_args: tuple[str, ...] = ()
    kv_dump_dir: Path | None = None
    md_orphan_s: float = 120.0
    wan_line_mbit: float = 0.0  # the WAN's rate, for P's codec choice (0 = measured)
    timing_dir: Path | None = None  # bench: each connector appends its hook timings here
    relay: bool = False  # also start RelayDecode beside P (fast path, not through the WAN)
    rld_transport: str = "auto"  # P -> RLD: auto | tcp | rdma
    rld_extra_args: tuple[str, ...] | None = None  # RLD's vLLM engine arguments (None: extra_args)
    sidecar_start_s: float = 240.0  # each sidecar's start limit (60 s was too short on a loaded CPU)
    pin_cores: bool = False  # P on one half of the cores, RLD and MD on the other (see engine_cores)


def engine_cores(cpus: set[int] | None = None) -> dict[str, tuple[int, ...]]:
    """Cores per vLLM server when one machine stands in for several: P gets the first half of the
    cores this process may use, RLD and MD the second half (P's prefill then never waits behind a
    decoder's step, as on machines of their own). Halves of equal size, so every server runs as many
    OpenMP threads and the same reductions (the answers stay comparable with P alone). Fewer than two
    cores: {} (no pinning)."""
    mine = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    half = len(mine) // 2
    if half == 0:
        return {}
    a, b = tuple(mine[:half]), tuple(mine[half : 2 * half])
    return {"p": a, "rld": b, "md": b}


class VllmPair:
    def __init__(self, spec: PairSpec) -> None:
        self.spec = spec
        self.md_side: SidecarProcess | None = None
        self.p_side: SidecarProcess | None = None
        self.rld_side: SidecarProcess | None = None
        self.md: VllmServer | None = None
        self.p: VllmServer | None = None
        self.rld: VllmServer | None = None
        self.md_kv_events = ""  # MD vLLM's KV-event publisher (a router's DRC mirror subscribes too)
        self.rld_kv_events = ""  # RLD vLLM's (its sidecar's DRC)
        self.cores: dict[str, tuple[int, ...]] = {}  # each server's cores when pinned

    def start(self, timeout_s: float = 300.0) -> VllmPair:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.close()  # nothing half-started stays behind
            raise

    def _side(self, role: str, name: str, **keys: Any) -> SidecarProcess:
        s = self.spec
        text = sidecar_toml(role, name, s.workdir, s.model_id, s.block_size, **keys)
        return SidecarProcess(s.workdir, name, text).start(s.sidecar_start_s)

    def _start(self, timeout_s: float) -> VllmPair:
        s = self.spec
        s.workdir.mkdir(parents=True, exist_ok=True)
        events = self.md_kv_events = f"ipc://{s.workdir / 'md-events.ipc'}"
        self.rld_kv_events = f"ipc://{s.workdir / 'rld-events.ipc'}" if s.relay else ""
        self.md_side = self._side(
            "md", "md0", kv_port=s.md_kv_port, kv_events_endpoint=events, orphan_s=s.md_orphan_s
        )
        port = self.md_side.kv_port
        md_addr = s.md_addr or (s.wan(port) if s.wan is not None else f"127.0.0.1:{port}")
        rld_addr = ""
        if s.relay:
            self.rld_side = self._side(
                "rld", "rld0", kv_events_endpoint=self.rld_kv_events, orphan_s=s.md_orphan_s
            )
            rld_addr = f"127.0.0.1:{self.rld_side.kv_port}"
        self.p_side = self._side(
            "p",
            "p0",
            md_kv=md_addr,
            rld_kv=rld_addr,
            wan_line_mbit=s.wan_line_mbit,
            fast_transport=s.rld_transport,
        )
        base = VllmServerSpec(
            s.model,
            0,
            dtype=s.dtype,
            block_size=s.block_size,
            kv_load_failure_policy=s.kv_load_failure_policy,
            extra_args=("--enable-prompt-tokens-details", *s.extra_args),
            kv_dump_dir=s.kv_dump_dir,
            timing_dir=s.timing_dir,
        )
        cores = engine_cores() if s.pin_cores else {}
        self.cores = cores
        self.md = VllmServer(
            replace(
                base,
                cpus=cores.get("md", ()),
                port=free_port(),
                kv_role="kv_consumer",
                control_socket=self.md_side.control_path,
                kv_events_endpoint=events,
                num_gpu_blocks=s.md_num_blocks,
            ),
            s.workdir / "md-vllm.log",
        ).start()
        self.p = VllmServer(
            replace(
                base,
                cpus=cores.get("p", ()),
                port=free_port(),
                kv_role="kv_producer",
                control_socket=self.p_side.control_path,
            ),
            s.workdir / "p-vllm.log",
        ).start()
        if self.rld_side is not None:
            rld_base = base if s.rld_extra_args is None else replace(base, extra_args=s.rld_extra_args)
            self.rld = VllmServer(
                replace(
                    rld_base,
                    cpus=cores.get("rld", ()),
                    port=free_port(),
                    kv_role="kv_consumer",
                    control_socket=self.rld_side.control_path,
                    kv_events_endpoint=self.rld_kv_events,
                    connector_extra=(("dump_tag", "RLD"),),
                ),
                s.workdir / "rld-vllm.log",
            ).start()
        for server in (self.md, self.p, self.rld):
            if server is not None:
                server.wait_ready(timeout_s)
        return self

    def servers(self) -> dict[str, VllmServer]:
        named = {"p": self.p, "md": self.md, "rld": self.rld}
        return {k: v for k, v in named.items() if v is not None}

    def restart(self, role: str, down_s: float = 0.0, timeout_s: float = 300.0) -> float:
        """``kill -9`` of ``role``'s vLLM, ``down_s`` without it, then the same server again; the
        seconds from the kill until it serves."""
        server = self.servers()[role]
        t0 = time.monotonic()
        server.kill()
        time.sleep(down_s)
        server.start()
        server.wait_ready(timeout_s)
        return time.monotonic() - t0

    def sides(self) -> dict[str, SidecarProcess]:
        named = {"p": self.p_side, "md": self.md_side, "rld": self.rld_side}
        return {k: v for k, v in named.items() if v is not None}

    def status(self) -> dict[str, Any]:
        return {k: side.status() for k, side in self.sides().items()}

    def shipped_all(self) -> dict[str, dict[str, Any]]:
        """P's record of every finished transfer."""
        assert self.p_side is not None
        done: dict[str, dict[str, Any]] = self.p_side.transfers()["done"]
        return done

    def shipped(self, transfer: str) -> dict[str, Any] | None:
        """P's finished record of ``transfer`` (per leg under "legs"), None while it is in flight."""
        return self.shipped_all().get(transfer)

    def finished(self, role: str = "md") -> dict[str, dict[str, Any]]:
        """vLLM's own prefix hit at each request's end, as ``role``'s sidecar saw it."""
        out: dict[str, dict[str, Any]] = self.sides()[role].transfers()["finished"]
        return out

    def in_flight(self, role: str = "md") -> list[str]:
        """The transfers ``role``'s sidecar holds now."""
        out: list[str] = self.sides()[role].transfers()["in_flight"]
        return out

    def close(self) -> None:
        for server in (self.p, self.rld, self.md):
            if server is not None:
                server.stop()
        for side in (self.p_side, self.rld_side, self.md_side):
            if side is not None:
                side.close()


def VllmTrio(spec: PairSpec) -> VllmPair:
    """P, RelayDecode and MD: a ``VllmPair`` with ``relay=True``."""
    return VllmPair(replace(spec, relay=True))
