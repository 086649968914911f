"""One run's legs, whatever the engine: ``pddlink.lifecycle.RequestRun``'s commands turned into calls
on the roles, once.

``LegDriver.execute`` reads every command the same way for every engine: which call starts (a
task under its ``TaskKey``, ``router.leg_tasks``), RLD's slot count, what ``CancelStreams`` ends,
which handoff call the run lets go of. What a call *is* differs per engine and lives behind
``RoleCalls``: the reference engine's sidecars over gRPC (``router.legs.GrpcCalls``) and vLLM's
OpenAI servers over HTTP (``router.vllm_legs.VllmCalls``). Each call is a coroutine that posts
what its role answers to the run's inbox as lifecycle events; what the calls of one run share
(the inbox, the tasks, the deadline, the router's books, the logprobs they saw) is ``LegRun``.

Teardown (``close``) is the engine's own: what may outlive the request differs (P's shipment to
MD on the reference engine, MD's prime on vLLM), so the request's next turn finds MD's cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from pddlink.lifecycle import (
    CancelStreams,
    DetachHandoff,
    Leg,
    OpenStream,
    ReleaseRldSlot,
    RunCommand,
    RunEvent,
    SendPrefill,
    StartHandoff,
    StreamClosed,
    StreamEnded,
    TakeOver,
)
from pddlink.roles import Role
from router.leg_tasks import LegTasks, TaskKind

MIN_TIMEOUT_S = 0.01


class Cluster(Protocol):
    """What a run needs of the router, whatever the engine: RLD's slot count and where to report
    P's and MD's prefill figures."""

    rld_active: int

    def on_prefilled(self, request_id: str, new_tokens: int, seconds: float) -> None: ...

    def on_md_ready(self, request_id: str, new_tokens: int, seconds: float) -> None: ...

    def on_md_stalled(self, seconds: float) -> None: ...


@dataclass(slots=True)
class LegRun:
    """What every call of one run shares: the router (``cluster``), the run's deadline, its inbox
    and tasks, and what the answers carried for the client beside the tokens: each token's
    logprobs by (role, absolute position), P's prefix hit as the engine reports it
    (``prompt_usage``) and P's prompt logprobs (vLLM fills these; the reference engine has none)."""

    cluster: Cluster
    deadline: float
    inbox: asyncio.Queue[RunEvent] = field(default_factory=asyncio.Queue)
    tasks: LegTasks = field(init=False)
    logprobs: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    prompt_usage: dict[str, int] | None = None
    prompt_logprobs: list[Any] | None = None

    def __post_init__(self) -> None:
        self.tasks = LegTasks(self.inbox)

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), MIN_TIMEOUT_S)


Call = Coroutine[Any, Any, Any]


class RoleCalls(Protocol):
    """One engine's calls for a run (see the module docstring). ``stream_kinds``: the calls on a
    role that ``CancelStreams`` ends (the reference engine's take-over is a unary call that MD's
    open stream answers, so only streams; on vLLM MD's prime, extend and take-over are streams)."""

    stream_kinds: frozenset[TaskKind]

    def stream(self, on: Role, leg: Leg) -> tuple[TaskKind, Call] | StreamClosed:
        """The call that opens ``leg``'s stream on ``on``, or why none can (the stream then ends)."""
        ...

    def prefill(self, cmd: SendPrefill) -> Call: ...

    def start_handoff(self, sid: str) -> Call: ...

    def take_over(self, cmd: TakeOver) -> Call: ...

    async def close(self, *, finished: bool) -> None: ...


class LegDriver:
    """One run's legs: the run's commands as ``calls`` (one engine's), on ``run``."""

    def __init__(self, run: LegRun, calls: RoleCalls) -> None:
        self.run, self.calls = run, calls
        self.inbox = run.inbox

    def execute(self, cmd: RunCommand) -> None:
        r, calls = self.run, self.calls
        if isinstance(cmd, OpenStream):
            opened = calls.stream(cmd.on, cmd.leg)
            if isinstance(opened, StreamClosed):
                r.inbox.put_nowait(StreamEnded(cmd.leg.sid, cmd.on, opened, None))
                return
            if cmd.on is Role.RLD:
                r.cluster.rld_active += 1
            r.tasks.spawn(opened[0], cmd.on, cmd.leg.sid, opened[1])
        elif isinstance(cmd, SendPrefill):
            r.tasks.spawn(TaskKind.PREFILL, Role.P, cmd.leg.sid, calls.prefill(cmd))
        elif isinstance(cmd, StartHandoff):
            r.tasks.spawn(TaskKind.HANDOFF, None, cmd.sid, calls.start_handoff(cmd.sid))
        elif isinstance(cmd, TakeOver):
            r.tasks.spawn(TaskKind.TAKE_OVER, Role.MD, cmd.leg.sid, calls.take_over(cmd))
        elif isinstance(cmd, CancelStreams):
            r.tasks.cancel(role=cmd.on, kinds=calls.stream_kinds)
        elif isinstance(cmd, ReleaseRldSlot):
            r.cluster.rld_active -= 1
        elif isinstance(cmd, DetachHandoff):
            r.tasks.forget(TaskKind.HANDOFF)  # RLD finishes; its handoff call ends by itself

    async def close(self, *, finished: bool) -> None:
        await self.calls.close(finished=finished)
