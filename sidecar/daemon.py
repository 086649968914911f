"""``pddlink sidecar``: one program beside one engine, whichever kind the file names
(``engine = "reference" | "vllm"``; the contract is ``engines_adapter.bridge``).

Lifecycle: ``run(cfg)`` opens the engine bridge and builds the role logic over it:

- ``reference``: the engine loaded in this process (``engine.mode = "thread"``) or started as a
  child ``pddlink engine`` that attaches over the engine link before anything else starts
  (``"process"``; stopped after everything else); the role logic is ``sidecar.reference``: the gRPC
  Sidecar service, P's prefiller, RLD's and MD's decoder, the KV server, MD's DRC.
- ``vllm``: the region and the control socket vLLM's connector dials; the role logic is
  ``sidecar.vllm_kv`` (P: the producer and its links; RLD, MD: the consumer and the KV server).
  vLLM itself is started with its own server command and the arguments
  ``pddlink sidecar --config F --print-vllm-args`` prints.

Then the role logic starts its listeners, the admin HTTP serves, one ``READY {json}`` line goes to
stdout (role, identity, engine kind, model, every bound port), the role logic announces itself
(membership, decoder dials), and the sidecar serves until SIGTERM/SIGINT or until its engine dies;
then the role logic drains and shuts down, the admin port closes and the bridge closes last. A
sidecar whose engine died exits with ``EngineDied`` (its supervisor restarts it).

Admin HTTP, the same beside either engine: GET /metrics (Prometheus), /healthz and /readyz (503 with
the reason once the engine is gone: a reference engine's process; a vLLM that died is reset and
waited for, so beside vLLM they stay 200), /status (JSON: role, identity, engine kind, model,
uptime, and what the role logic and the bridge hold), /memory (JSON: where the heap is,
``pddlink.serving.malloc_trim.heap_stats``), plus the role logic's own (/drc/* on a reference MD,
/transfers beside vLLM). On the TCP port (``admin_port``) everything but /healthz and /readyz needs
a bearer key of ``admin_keys_file`` when one is set (``pddlink.serving.admin_access``); the unix
socket (``admin_unix``, mode 0600) needs none. Memory: a fixed mmap threshold so KV buffers go back
to the OS when freed, the startup objects frozen out of the collector's view
(``pddlink.serving.malloc_trim``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from engines_adapter.bridge import EngineBridge
from pddlink import eventloop, metrics
from pddlink.errors import Unavailable
from pddlink.serving.admin_access import guarded
from pddlink.serving.client_guard import load_key_file
from pddlink.serving.http import Request, Response, error_response, json_response, serve_http
from pddlink.serving.malloc_trim import fix_mmap_threshold, freeze_startup, heap_stats, types_asked
from sidecar.config import SidecarConfig


class EngineDied(Unavailable):
    """The engine process beside this sidecar died: the sidecar stops (its supervisor restarts it)."""


class RoleLogic(Protocol):
    """What the daemon runs over a bridge: ``sidecar.reference.ReferenceSidecar`` or
    ``sidecar.vllm_kv.roles.VllmRoles``."""

    @property
    def bridge(self) -> EngineBridge: ...

    async def start(self, ready: dict[str, Any], stop: asyncio.Event) -> None: ...

    def announce(self, ready: dict[str, Any]) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def health(self) -> str: ...

    def failure(self) -> str: ...

    async def admin(self, req: Request) -> Response | None: ...

    async def stop(self) -> None: ...


class Daemon:
    def __init__(self, cfg: SidecarConfig, roles: RoleLogic) -> None:
        self.cfg, self.roles = cfg, roles
        self.started = time.time()
        keys = cfg.admin_keys_file
        self.admin_keys = load_key_file(keys, "admin_keys_file") if keys else ()

    def status(self) -> dict[str, Any]:
        b = self.roles.bridge
        return {
            "role": self.cfg.role,
            "peer_id": self.cfg.name,
            "engine_kind": b.kind.value,
            "model_id": b.model_id,
            "uptime_s": time.time() - self.started,
            **self.roles.status(),
        }

    async def admin(self, req: Request) -> Response:
        if req.method == "GET" and req.path == "/metrics":
            text, ctype = metrics.render()
            return Response(200, text, ctype)
        if req.method == "GET" and req.path in ("/healthz", "/readyz"):
            why = self.roles.health()
            body: dict[str, Any] = {"ok": not why, "ready": not why, "role": self.cfg.role}
            body["engine"] = self.roles.bridge.kind.value
            if why:
                body["error"] = why
            return json_response(503 if why else 200, body)
        if req.method == "GET" and req.path == "/status":
            return json_response(200, self.status())
        if req.method == "GET" and req.path == "/memory":  # tens of ms: asked for, never polled
            return json_response(200, heap_stats(top_types=types_asked(req.query)))
        own = await self.roles.admin(req)
        return own if own is not None else error_response(404, f"no such endpoint: {req.method} {req.path}")

    async def _start_admin(self) -> list[asyncio.Server]:
        cfg = self.cfg
        servers: list[asyncio.Server] = []
        if cfg.admin_port:  # TCP: bearer keys (pddlink.serving.admin_access)
            servers += await serve_http(
                guarded(self.admin, self.admin_keys), host=cfg.host, port=cfg.admin_port
            )
        if cfg.admin_unix:  # keyless, owner only (the CLI's umask already made it so; this says it exactly)
            servers += await serve_http(self.admin, unix=cfg.admin_unix)
            os.chmod(cfg.admin_unix, 0o600)
        return servers

    async def serve(self, stop: asyncio.Event) -> None:
        cfg, roles = self.cfg, self.roles
        ready: dict[str, Any] = {
            "role": cfg.role,
            "peer_id": cfg.name,
            "engine": roles.bridge.kind.value,
            "model_id": roles.bridge.model_id,
        }
        admin: list[asyncio.Server] = []
        try:
            await roles.start(ready, stop)
            admin = await self._start_admin()
            ready["admin_port"] = cfg.admin_port
            roles.announce(ready)
            sys.stdout.write("READY " + json.dumps(ready) + "\n")
            sys.stdout.flush()
            freeze_startup()  # full GC collections walk only what serving makes
            await stop.wait()
        finally:
            await roles.stop()
            for s in admin:
                s.close()
            if cfg.admin_unix:
                Path(cfg.admin_unix).unlink(missing_ok=True)
            await roles.bridge.close()
        if why := roles.failure():
            raise EngineDied(f"sidecar {cfg.role}/{cfg.name} stopped: {why}")


async def _main(cfg: SidecarConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if cfg.engine_kind == "vllm":
        from sidecar.vllm_kv.roles import VllmRoles

        await Daemon(cfg, VllmRoles(cfg)).serve(stop)
        return
    from sidecar.reference import ReferenceSidecar, adapter_bridge

    if cfg.engine.mode == "process":
        from sidecar.engine_process import EngineProcessTimeouts, engine_process

        timeouts = EngineProcessTimeouts(
            attach_s=cfg.engine.attach_timeout_s, call_s=cfg.engine.call_timeout_s
        )
        async with engine_process(cfg.engine, timeouts, sidecar=f"{cfg.role}/{cfg.name}") as engine:
            await Daemon(cfg, ReferenceSidecar(cfg, adapter_bridge(cfg, engine))).serve(stop)
        return
    await Daemon(cfg, ReferenceSidecar(cfg, adapter_bridge(cfg))).serve(stop)


def run(cfg: SidecarConfig) -> None:
    fix_mmap_threshold()  # KV buffers go back to the OS when freed (pddlink.serving.malloc_trim)
    eventloop.run(_main(cfg))
