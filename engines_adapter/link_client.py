"""The engine's end of the engine link: dial the sidecar, say Hello, serve its commands.

Lifecycle: ``serve_engine(engine, target, token)`` connects (bounded by ``connect_timeout_s``),
opens the Attach stream, sends Hello (layout, vocabulary, pool size, pid, the attach token), then
runs each command the sidecar sends on ``engine`` in arrival order (one at a time: an engine is not
thread-safe) and answers it. It returns when the sidecar ends the stream; a refused Hello or a
lost sidecar raises ``Unavailable`` with the sidecar's reason. The process that runs it is the
engine process (``pddlink engine --sidecar ADDR``).

Memory: the engine process moves every request's KV (exports on P, imports on RLD and MD), MiBs a
command, queued by the link under load; like a sidecar (``pddlink.serving.malloc_trim``) it gives freed
heap pages back every ``TRIM_EVERY_S`` while it waits for commands, and ``pddlink engine`` pins
glibc's mmap threshold (at 1 MiB: ``ENGINE_MMAP_THRESHOLD``), so those buffers are unmapped when
freed: without, MD's engine process kept 33-39 MiB more after the chaos load than after its warm-up
(issue 16).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]

from engines_adapter import EngineAdapter
from engines_adapter import link_codec as codec
from pddlink.errors import ConfigError, Unavailable
from pddlink.serving.malloc_trim import trim_every
from pddlink.serving.rpc import engine_stubs

pb2, pb2_grpc = engine_stubs()
MAX_MESSAGE_BYTES = 512 << 20
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
_REFUSALS = (
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT,
)


def hello(engine: EngineAdapter, token: str, engine_name: str, capacity_blocks: int) -> Any:
    return pb2.EngineMessage(
        hello=pb2.Hello(
            attach_token=token,
            layout=codec.layout_msg(engine.layout),
            vocab_size=engine.vocab_size,
            capacity_blocks=capacity_blocks,
            pid=os.getpid(),
            engine_name=engine_name,
        )
    )


def serve_engine(
    engine: EngineAdapter,
    target: str,
    token: str,
    *,
    engine_name: str = "torch_ref",
    capacity_blocks: int = 0,
    connect_timeout_s: float = 30.0,
) -> int:
    """Serve the sidecar at ``target`` until it ends the link; returns the commands served."""
    return asyncio.run(_serve(engine, target, token, engine_name, capacity_blocks, connect_timeout_s))


async def _serve(
    engine: EngineAdapter,
    target: str,
    token: str,
    engine_name: str,
    capacity_blocks: int,
    connect_timeout_s: float,
) -> int:
    trimmer = asyncio.get_running_loop().create_task(trim_every())  # runs between commands
    try:
        return await _serve_link(engine, target, token, engine_name, capacity_blocks, connect_timeout_s)
    finally:
        trimmer.cancel()


async def _serve_link(
    engine: EngineAdapter,
    target: str,
    token: str,
    engine_name: str,
    capacity_blocks: int,
    connect_timeout_s: float,
) -> int:
    # One thread reads a command, runs it (blocking this loop, which serves nothing else) and
    # writes the reply: no hand-off between threads on the way, which matters on busy CPUs.
    served = 0
    async with grpc.aio.insecure_channel(target, options=GRPC_OPTIONS) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), connect_timeout_s)
        except TimeoutError:
            raise Unavailable(f"no sidecar at {target} within {connect_timeout_s:.0f} s") from None
        call = pb2_grpc.EngineLinkStub(channel).Attach()
        try:
            await call.write(hello(engine, token, engine_name, capacity_blocks))
            while (msg := await call.read()) is not EOF:
                if msg.WhichOneof("kind") == "welcome":
                    sys.stderr.write(f"engine {os.getpid()}: attached to {msg.welcome.sidecar or target}\n")
                    continue
                reply = codec.execute(engine, msg.command, time.monotonic())
                await call.write(pb2.EngineMessage(reply=reply))
                served += 1
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code in _REFUSALS:
                raise ConfigError(f"the sidecar refused this engine: {details}") from None
            if code != grpc.StatusCode.CANCELLED:
                raise Unavailable(f"engine link to {target} lost: {code.name} {details}") from None
    return served
