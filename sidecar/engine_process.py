"""The sidecar's engine as a child process (``engine_mode = "process"``).

Lifecycle: ``async with engine_process(engine_cfg, timeouts) as engine:`` hosts the EngineLink
service on a unix socket in a private temporary directory, starts ``pddlink engine --sidecar
unix:...`` as a child (same process group, so a kill of the sidecar's group takes it too; it also
dies with its parent), waits for it to attach (bounded; an early exit is reported with its exit
code), and yields a ``RemoteEngine``. A watcher fails the link the moment the child exits. On
leaving: the link is closed, the child gets SIGTERM, then SIGKILL after a grace period, and the
socket directory is removed (already once the engine attached): no orphan, no leftover file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engines_adapter.link_server import (
    EngineExpectation,
    EngineGone,
    EngineLinkServer,
    EngineSession,
    RemoteEngine,
)
from pddlink.cli.engine import TOKEN_ENV
from pddlink.errors import ConfigError
from sidecar.config import EngineConfig


@dataclass(frozen=True, slots=True)
class EngineProcessTimeouts:
    attach_s: float = 120.0  # the child imports torch and builds the model first
    call_s: float = 30.0  # every engine command
    stop_grace_s: float = 3.0

    def __post_init__(self) -> None:
        if min(self.attach_s, self.call_s, self.stop_grace_s) <= 0:
            raise ConfigError("engine process timeouts must be > 0")


def engine_argv(cfg: EngineConfig, target: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pddlink.cli.main",
        "engine",
        "--sidecar",
        target,
        "--name",
        cfg.name,
        "--preset",
        cfg.preset,
        "--dtype",
        cfg.dtype,
        "--block-size",
        str(cfg.block_size),
        "--num-blocks",
        str(cfg.num_blocks),
        "--seed",
        str(cfg.seed),
        "--prefill-slowdown",
        str(cfg.prefill_slowdown),
        "--die-with-parent",
    ]


async def _stop_child(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.wait_for(proc.wait(), grace_s)


async def _attach(
    server: EngineLinkServer, proc: asyncio.subprocess.Process, timeout_s: float
) -> EngineSession:
    attach = asyncio.ensure_future(server.wait_attached(timeout_s))
    exited = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait({attach, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        exited.cancel()
    if not attach.done():
        attach.cancel()
        raise EngineGone(f"the engine process exited with code {proc.returncode} before attaching")
    return attach.result()


@contextlib.asynccontextmanager
async def engine_process(
    cfg: EngineConfig, timeouts: EngineProcessTimeouts | None = None, *, sidecar: str = ""
) -> AsyncIterator[RemoteEngine]:
    t = timeouts or EngineProcessTimeouts()
    run_dir = tempfile.mkdtemp(prefix="pddlink-engine-")  # mode 0700: only this user can dial
    target = f"unix:{os.path.join(run_dir, 'link.sock')}"
    token = secrets.token_hex(16)
    expect = EngineExpectation(dtype=cfg.dtype, block_size=cfg.block_size, capacity_blocks=cfg.num_blocks)
    server = EngineLinkServer(token, expect, sidecar=sidecar)
    proc: asyncio.subprocess.Process | None = None
    watcher: asyncio.Task[None] | None = None
    try:
        # the child first (it keeps dialing until the socket is there): forking before gRPC's
        # threads run spares grpc's fork handlers
        proc = await asyncio.create_subprocess_exec(
            *engine_argv(cfg, target),
            env=dict(os.environ, **{TOKEN_ENV: token}),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),  # stdout is the sidecar's READY channel
        )
        await server.start(target)
        session = await _attach(server, proc, t.attach_s)
        # attached: nobody else needs the socket's name (and nobody else may dial it); removing it
        # now leaves nothing behind even if this process is killed without its cleanup
        shutil.rmtree(run_dir, ignore_errors=True)
        child = proc

        async def watch() -> None:
            code = await child.wait()
            session.fail(EngineGone(f"the engine process {child.pid} exited with code {code}"))

        watcher = asyncio.create_task(watch(), name="engine-process-watch")
        yield RemoteEngine(session, asyncio.get_running_loop(), t.call_s)
    finally:
        if watcher is not None:
            watcher.cancel()
        await server.stop()
        if proc is not None:
            await _stop_child(proc, t.stop_grace_s)
        shutil.rmtree(run_dir, ignore_errors=True)
