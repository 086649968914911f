"""The sidecar's end of the engine link: the EngineLink gRPC service and ``RemoteEngine``.

Lifecycle: ``server = EngineLinkServer(token, expect=...)``; ``await server.start("unix:/path")``;
the engine process (``pddlink engine --sidecar unix:/path``) attaches and says Hello; ``session =
await server.wait_attached(timeout_s)``; ``RemoteEngine(session, loop, call_timeout_s)`` is an
``EngineAdapter`` the sidecar's ``EngineLoop`` drives unchanged; ``await server.stop()``.

Threads: the event loop owns the stream. ``EngineLoop.call`` awaits ``call_async`` there (no
thread in between); the synchronous contract methods serve callers on other threads (the engine
loop's worker, e.g. DRC evictions): each hands its command to the event loop and blocks on the
reply, never longer than its deadline. A synchronous call on the event loop's own thread is
refused (it would wait on itself). Every command has a deadline; when the engine goes
away (stream closed, process exited) every call in flight and every later one fails at once with
``EngineGone`` (an ``Unavailable``); a late reply to a timed-out command is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]

from engines_adapter import (
    EngineAdapter,
    EngineError,
    KVBlocks,
    KVLayout,
    SamplingParams,
    StepOutput,
)
from engines_adapter import link_codec as codec
from pddlink.errors import ConfigError, DeadlineExceeded, Unavailable
from pddlink.serving.rpc import engine_stubs

pb2, pb2_grpc = engine_stubs()
MAX_MESSAGE_BYTES = 512 << 20  # KV payloads travel as bytes fields
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class EngineGone(EngineError, Unavailable):
    """The engine process is not attached (never came, exited, or closed its link)."""


class EngineTimeout(EngineError, DeadlineExceeded):
    """The engine did not answer a command within its deadline."""


@dataclass(frozen=True, slots=True)
class EngineExpectation:
    """What the sidecar's configuration says the engine must be; a Hello that differs is refused."""

    dtype: str = ""
    block_size: int = 0
    capacity_blocks: int = 0

    def mismatch(self, hello: Any) -> str:
        got = hello.layout
        if self.dtype and got.dtype != self.dtype:
            return f"engine dtype {got.dtype!r}, configured {self.dtype!r}"
        if self.block_size and got.block_size != self.block_size:
            return f"engine block_size {got.block_size}, configured {self.block_size}"
        if self.capacity_blocks and hello.capacity_blocks != self.capacity_blocks:
            return f"engine pool {hello.capacity_blocks} blocks, configured {self.capacity_blocks}"
        return ""


class EngineSession:
    """One attached engine: the Attach stream, commands in flight, their replies."""

    def __init__(self, hello: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.hello = hello
        self.layout = codec.layout_of(hello.layout)
        self._context = context
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._outbox: asyncio.Queue[Any] = asyncio.Queue()
        self.gone: EngineGone | None = None
        self.done = asyncio.Event()

    @property
    def alive(self) -> bool:
        return self.gone is None

    async def run(self) -> None:
        """Pump commands out and replies in until either side ends; then fail what is in flight."""
        reader = asyncio.create_task(self._read(), name="engine-link-read")
        writer = asyncio.create_task(self._write(), name="engine-link-write")
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (reader, writer):
                t.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            self.fail(EngineGone(f"engine (pid {self.hello.pid}) closed its link"))

    async def _read(self) -> None:
        while True:
            msg = await self._context.read()
            if msg is EOF:
                return
            if msg.WhichOneof("kind") != "reply":
                continue
            fut = self._pending.get(msg.reply.command_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.reply)

    async def _write(self) -> None:
        while True:
            msg = await self._outbox.get()
            if msg is None:
                return
            await self._context.write(msg)

    def fail(self, exc: EngineGone) -> None:
        """The engine is gone: every call in flight and every later one raises ``exc``'s kind."""
        if self.gone is None:
            self.gone = exc
            sys.stderr.write(f"engine link: {exc.message}\n")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineGone(exc.message))
        self._outbox.put_nowait(None)
        self.done.set()

    async def request(self, op: str, msg: Any, timeout_s: float) -> Any:
        """Send one command and wait for its reply; raise the engine's error as its own class."""
        if self.gone is not None:
            raise EngineGone(self.gone.message)
        cid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        cmd = pb2.Command(command_id=cid, deadline_s=timeout_s, **{op: msg})
        self._outbox.put_nowait(pb2.SidecarMessage(command=cmd))
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise EngineTimeout(f"engine {op} got no answer within {timeout_s:.1f} s") from None
        finally:
            self._pending.pop(cid, None)
        if reply.WhichOneof("result") == "error":
            codec.raise_error(reply.error)
        return reply

    def close(self) -> None:
        self.fail(EngineGone("the sidecar closed the engine link"))


class EngineLinkService(pb2_grpc.EngineLinkServicer):  # type: ignore[misc,name-defined]
    """Accepts one engine at a time: checks its token and layout, then serves its session."""

    def __init__(self, token: str, expect: EngineExpectation, sidecar: str, hello_timeout_s: float) -> None:
        self.token, self.expect, self.sidecar = token, expect, sidecar
        self.hello_timeout_s = hello_timeout_s
        self.session: EngineSession | None = None
        self.attached: asyncio.Future[EngineSession] = asyncio.get_running_loop().create_future()

    async def Attach(self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        try:
            first = await asyncio.wait_for(context.read(), self.hello_timeout_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Hello in time")
        if first is EOF or first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Hello")
        hello = first.hello
        if hello.attach_token != self.token:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong attach token")
        if self.session is not None and self.session.alive:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "an engine is already attached")
        why = self.expect.mismatch(hello)
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        session = EngineSession(hello, context)
        self.session = session
        await context.write(pb2.SidecarMessage(welcome=pb2.Welcome(sidecar=self.sidecar)))
        if not self.attached.done():
            self.attached.set_result(session)
        await session.run()


class EngineLinkServer:
    """The grpc.aio server hosting EngineLink for one engine (a unix socket or loopback)."""

    def __init__(
        self, token: str, expect: EngineExpectation, *, sidecar: str = "", hello_timeout_s: float = 10.0
    ) -> None:
        self._args = (token, expect, sidecar, hello_timeout_s)
        self._server: grpc.aio.Server | None = None
        self.service: EngineLinkService | None = None
        self.port = 0

    async def start(self, address: str) -> None:
        self.service = EngineLinkService(*self._args)
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        pb2_grpc.add_EngineLinkServicer_to_server(self.service, self._server)
        self.port = self._server.add_insecure_port(address)
        await self._server.start()

    async def wait_attached(self, timeout_s: float) -> EngineSession:
        if self.service is None:
            raise EngineGone("the engine link server is not started")
        try:
            return await asyncio.wait_for(asyncio.shield(self.service.attached), timeout_s)
        except TimeoutError:
            raise EngineGone(f"no engine attached within {timeout_s:.0f} s") from None

    async def stop(self, grace_s: float = 0.5) -> None:
        if self.service is not None and self.service.session is not None:
            self.service.session.close()
        if self._server is not None:
            await self._server.stop(grace_s)


class RemoteEngine(EngineAdapter):
    """An engine in another process, reached over the engine link (see the module docstring)."""

    def __init__(
        self, session: EngineSession, loop: asyncio.AbstractEventLoop, call_timeout_s: float = 30.0
    ) -> None:
        if call_timeout_s <= 0:
            raise ConfigError("engine call_timeout_s must be > 0")
        self.session, self._loop, self.call_timeout_s = session, loop, call_timeout_s
        self._layout = session.layout

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def vocab_size(self) -> int:
        return int(self.session.hello.vocab_size)

    @property
    def alive(self) -> bool:
        return self.session.alive

    def _call(self, op: str, msg: Any) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise EngineError(f"RemoteEngine.{op} called on the event loop's thread (use EngineLoop.call)")
        timeout_s = self.call_timeout_s
        try:
            fut = asyncio.run_coroutine_threadsafe(self.session.request(op, msg, timeout_s), self._loop)
        except RuntimeError:  # the event loop is closed: the sidecar is shutting down
            raise EngineGone("the sidecar's event loop is closed") from None
        try:
            return fut.result(timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise EngineTimeout(f"engine {op} got no answer within {timeout_s:.1f} s") from None
        except concurrent.futures.CancelledError:
            raise EngineGone(f"engine {op} cancelled: the sidecar is shutting down") from None

    def _run(self, plan: codec.Plan) -> Any:
        return plan.unpack(self._call(plan.op, plan.msg))

    async def call_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The contract method ``method`` without a thread: for callers on the event loop (the
        sidecar's ``EngineLoop``), which then waits for the reply without blocking the loop."""
        plan = codec.PLANS[method](*args, **kwargs)
        return plan.unpack(await self.session.request(plan.op, plan.msg, self.call_timeout_s))

    def prefill(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> StepOutput:
        out: StepOutput = self._run(codec.plan_prefill(request_id, prompt, sampling))
        return out

    def decode(self, request_ids: Sequence[str]) -> list[StepOutput]:
        outs: list[StepOutput] = self._run(codec.plan_decode(request_ids))
        return outs

    def extend(self, request_id: str, token_ids: Sequence[int]) -> StepOutput:
        out: StepOutput = self._run(codec.plan_extend(request_id, token_ids))
        return out

    def import_kv(
        self,
        request_id: str,
        prompt: Sequence[int],
        blocks: Sequence[KVBlocks],
        sampling: SamplingParams,
        *,
        reuse_prefix_tokens: int = 0,
    ) -> None:
        self._run(
            codec.plan_import_kv(
                request_id, prompt, blocks, sampling, reuse_prefix_tokens=reuse_prefix_tokens
            )
        )

    def export_kv(self, request_id: str, first_block: int = 0, num_blocks: int | None = None) -> KVBlocks:
        kv: KVBlocks = self._run(codec.plan_export_kv(request_id, first_block, num_blocks))
        return kv

    def release(self, request_id: str, *, cache_prefix: bool = True) -> None:
        self._run(codec.plan_release(request_id, cache_prefix=cache_prefix))

    def cached_prefix_tokens(self, prompt: Sequence[int]) -> int:
        return int(self._run(codec.plan_cached_prefix_tokens(prompt)))

    def evict_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        return int(self._run(codec.plan_evict_prefix_blocks(block_hashes)))

    def drain_evicted_hashes(self) -> list[int]:
        return list(self._run(codec.plan_drain_evicted_hashes()))

    def tokens(self, request_id: str) -> list[int]:
        toks: list[int] = self._run(codec.plan_tokens(request_id))
        return toks


__all__ = [
    "EngineExpectation",
    "EngineGone",
    "EngineLinkServer",
    "EngineTimeout",
    "RemoteEngine",
]
