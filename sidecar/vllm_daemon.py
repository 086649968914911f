"""The sidecar beside a vLLM server: ``pddlink sidecar --config F`` where the file says
``engine = "vllm"``.

The same program as beside the reference engine, with vLLM's half of the engine contract
(``sidecar.vllm_kv``): vLLM schedules itself, so there is no engine-facing gRPC service; the
connector inside vLLM dials this process's control socket (``<vllm.workdir>/<peer_id>.sock``), KV
moves through the shared-memory region, and on RelayDecode and MainDecode the DRC follows vLLM's
KV-cache events. Lifecycle: build the ``VllmSidecarConfig`` from the file, start (the KV server on
RLD/MD, the links on P, the control socket), serve the admin HTTP (``/healthz``, ``/readyz``,
``/status``, ``/transfers``, ``/memory``, ``/metrics``; bearer keys on TCP as for the reference
sidecar), print one ``READY {json}`` line, and on SIGTERM or SIGINT close everything (the region and
the socket are removed). Memory as the reference sidecar keeps it (``pddlink.serving.malloc_trim``):
a fixed mmap threshold so KV buffers go back to the OS when freed, the startup objects frozen out of
the collector's view, and a collection plus ``malloc_trim`` every few seconds; otherwise a sidecar
living through its engine's restarts ended a chaos run at 1.14-1.19x its RSS after warm-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from pddlink import eventloop, metrics
from pddlink.roles import Role
from pddlink.serving.admin_access import guarded
from pddlink.serving.client_guard import load_key_file
from pddlink.serving.http import Request, Response, error_response, json_response, serve_http
from pddlink.serving.malloc_trim import (
    fix_mmap_threshold,
    freeze_startup,
    heap_stats,
    trim_every,
    types_asked,
)
from pddlink.transport import LinkOptions
from sidecar.config import SidecarConfig
from sidecar.vllm_kv.service import VllmSidecar, VllmSidecarConfig


def bridge_config(cfg: SidecarConfig) -> VllmSidecarConfig:
    """The vLLM bridge's configuration from the sidecar's file."""
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


class VllmAdmin:  # /status: counts; /transfers: each transfer's record (tools and tests)
    """The admin endpoints of a sidecar beside vLLM."""

    def __init__(self, cfg: SidecarConfig, side: VllmSidecar) -> None:
        self.cfg, self.side = cfg, side

    async def __call__(self, req: Request) -> Response:
        if req.method == "GET" and req.path == "/metrics":
            body, ctype = metrics.render()
            return Response(200, body, ctype)
        if req.method == "GET" and req.path in ("/healthz", "/readyz"):
            return json_response(200, {"ok": True, "ready": True, "role": self.cfg.role, "engine": "vllm"})
        if req.method == "GET" and req.path == "/status":
            return json_response(200, self.status())
        if req.method == "GET" and req.path == "/transfers":
            return json_response(200, self.transfers())
        if req.method == "GET" and req.path == "/memory":  # tens of ms: asked for, never polled
            return json_response(200, heap_stats(types_asked(req.query)))
        return error_response(404, f"no such endpoint: {req.method} {req.path}")

    def transfers(self) -> dict[str, object]:
        """P: every finished transfer's record (``done``, bounded); RLD/MD: vLLM's own hit at each
        request's end (``finished``), the transfers held now (``in_flight``), the DRC's leases."""
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

    def status(self) -> dict[str, object]:
        return {
            "role": self.cfg.role,
            "peer_id": self.cfg.name,
            "engine_kind": "vllm",  # "engine": the watch on the vLLM process (engine_watch)
            "control_socket": str(self.side.control_path),
            **self.side.status(),
        }


async def serve(cfg: SidecarConfig, stop: asyncio.Event) -> None:
    side = await VllmSidecar(bridge_config(cfg)).start()
    servers: list[asyncio.Server] = []
    trimmer: asyncio.Task[None] | None = None
    try:
        admin = VllmAdmin(cfg, side)
        if cfg.admin_port:
            keys = load_key_file(cfg.admin_keys_file, "admin_keys_file") if cfg.admin_keys_file else ()
            servers += await serve_http(guarded(admin, keys), host=cfg.host, port=cfg.admin_port)
        if cfg.admin_unix:
            servers += await serve_http(admin, unix=cfg.admin_unix)
            os.chmod(cfg.admin_unix, 0o600)
        ready = {
            "role": cfg.role,
            "engine": "vllm",
            "control_socket": str(side.control_path),
            "admin_port": cfg.admin_port,
            "kv_port": side.kv_port if cfg.role != "p" else 0,
        }
        if not cfg.tls_dir:
            sys.stderr.write("sidecar: plaintext KV data plane (tls_dir ''): loopback, tests and labs only\n")
        sys.stdout.write("READY " + json.dumps(ready) + "\n")
        sys.stdout.flush()
        freeze_startup()  # full GC collections walk only what serving makes
        trimmer = asyncio.get_running_loop().create_task(trim_every(), name="malloc-trim")
        await stop.wait()
    finally:
        if trimmer is not None:
            trimmer.cancel()
        for s in servers:
            s.close()
        if cfg.admin_unix:
            Path(cfg.admin_unix).unlink(missing_ok=True)
        await side.close()


async def _main(cfg: SidecarConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(cfg, stop)


def run(cfg: SidecarConfig) -> None:
    fix_mmap_threshold()  # KV buffers go back to the OS when freed
    eventloop.run(_main(cfg))
