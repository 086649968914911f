"""The role logic beside vLLM as the daemon (``sidecar.daemon``) runs it: ``VllmSidecar`` built from
the sidecar's file (``sidecar_config``), its READY fields (the control socket, the KV port on RLD and
MD), its admin endpoint ``/transfers`` (P: every finished transfer's record; RLD/MD: vLLM's own hit
at each request's end, the transfers held now, the DRC's leases), and the periodic heap trim
(``pddlink.serving.malloc_trim.trim_every``: a sidecar living through its engine's restarts ended a
chaos run at 1.14-1.19x its RSS after warm-up without it).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from engines_adapter.vllm.bridge import VllmBridge
from pddlink.roles import Role
from pddlink.serving.http import Request, Response, json_response
from pddlink.serving.malloc_trim import trim_every
from pddlink.transport import LinkOptions
from sidecar.config import SidecarConfig
from sidecar.vllm_kv.service import VllmSidecar, VllmSidecarConfig


def sidecar_config(cfg: SidecarConfig) -> VllmSidecarConfig:
    """The vLLM role logic's configuration from the sidecar's file."""
    v, peers, dp = cfg.vllm, cfg.peers, cfg.data_plane
    return VllmSidecarConfig(
        role=Role(cfg.role),
        name=cfg.name,
        workdir=Path(v.workdir),
        model_id=v.model_id,
        block_size=v.block_size,
        region_bytes=v.region_bytes,
        region_dir=Path(v.region_dir) if v.region_dir else None,
        md_addr=peers.md_kv if cfg.role == "p" else "",
        rld_addr=peers.rld_kv if cfg.role == "p" else "",
        md_peers=peers.kv_peers(Role.MD) if cfg.role == "p" else (),
        rld_peers=peers.kv_peers(Role.RLD) if cfg.role == "p" else (),
        rld_transport=dp.fast_transport,
        kv_host=cfg.host,
        kv_port=cfg.kv_port,
        transport=dp.wan_transport,
        tls_dir=Path(cfg.tls_dir) if cfg.tls_dir else None,
        options=LinkOptions(streams=dp.wan_streams, chunk_bytes=dp.chunk_bytes),
        kv_events_endpoint=v.kv_events_endpoint if cfg.role != "p" else "",
        orphan_s=v.orphan_s,
        wan_line_mbit=dp.wan_line_mbit,
        wan_codec=dp.wan_codec,
        allow_plaintext_non_loopback=cfg.allow_plaintext_non_loopback,
    )


class VllmRoles:
    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.side = VllmSidecar(sidecar_config(cfg))
        self.trimmer: asyncio.Task[None] | None = None

    @property
    def bridge(self) -> VllmBridge:
        return self.side.bridge

    async def start(self, ready: dict[str, Any], stop: asyncio.Event) -> None:
        await self.side.start()
        ready["control_socket"] = str(self.side.control_path)
        ready["kv_port"] = self.side.kv_port if self.cfg.role != "p" else 0
        if not self.cfg.tls_dir:
            sys.stderr.write("sidecar: plaintext KV data plane (tls_dir ''): loopback, tests and labs only\n")

    def announce(self, ready: dict[str, Any]) -> None:
        self.trimmer = asyncio.get_running_loop().create_task(trim_every(), name="malloc-trim")

    def status(self) -> dict[str, Any]:
        return {"control_socket": str(self.side.control_path), **self.side.status()}

    def health(self) -> str:
        return self.bridge.health()

    def failure(self) -> str:
        return ""  # a vLLM that dies is reset and waited for; the sidecar stops only when asked

    async def admin(self, req: Request) -> Response | None:
        if req.method == "GET" and req.path == "/transfers":
            return json_response(200, self.transfers())
        return None

    def transfers(self) -> dict[str, object]:
        side = self.side
        if side.producer is not None:
            return {"done": dict(side.producer.done)}
        if side.consumer is not None:
            c = side.consumer
            return {
                "finished": dict(c.finished),
                "in_flight": sorted(c.inc),
                "leases": c.index.stats().reservations,
            }
        return {}

    async def stop(self) -> None:
        if self.trimmer is not None:
            self.trimmer.cancel()
        await self.side.close()
