"""The one leg driver (``router.leg_driver.LegDriver``) reads every lifecycle command the same way
whatever the engine: which call of the engine's ``RoleCalls`` starts, RLD's slot count, what
``CancelStreams`` ends (the engine's ``stream_kinds``), a stream no role can take, a detached
handoff. In memory: the calls here are coroutines that wait until cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

from engines_adapter.base import SamplingParams
from pddlink.lifecycle import (
    CancelStreams,
    DetachHandoff,
    Leg,
    OpenStream,
    ReleaseRldSlot,
    SendPrefill,
    StartHandoff,
    StreamClosed,
    StreamEnd,
    StreamEnded,
    TakeOver,
)
from pddlink.roles import Role
from pddlink.routing import Pipeline
from router.leg_driver import Call, LegDriver, LegRun
from router.leg_tasks import TaskKind

LEG = Leg("r1", (1, 2, 3), SamplingParams(max_tokens=4), Pipeline.P_RLD_MD)


class Cluster:
    """The router as a run's legs see it (``router.leg_driver.Cluster``): RLD's slots, and books
    that take nothing in."""

    rld_active = 0

    def on_prefilled(self, request_id: str, new_tokens: int, seconds: float) -> None:
        pass

    def on_md_ready(self, request_id: str, new_tokens: int, seconds: float) -> None:
        pass

    def on_md_stalled(self, seconds: float) -> None:
        pass


class Calls:
    """An engine whose every call waits until it is cancelled; MD's relay leg primes first (as
    vLLM's does); ``rld`` False: no RLD beside P (as a reference engine's route may say)."""

    def __init__(self, stream_kinds: frozenset[TaskKind], rld: bool = True) -> None:
        self.stream_kinds = stream_kinds
        self.rld = rld
        self.started: list[str] = []
        self.closed: bool | None = None

    async def _wait(self, what: str) -> None:
        self.started.append(what)
        await asyncio.Event().wait()

    def stream(self, on: Role, leg: Leg) -> tuple[TaskKind, Call] | StreamClosed:
        if on is Role.RLD and not self.rld:
            return StreamClosed(StreamEnd.FAILED, "no_rld_beside_p")
        kind = TaskKind.PRIME if on is Role.MD and leg.pipeline is Pipeline.P_RLD_MD else TaskKind.STREAM
        return kind, self._wait(f"{on.value}:{kind.value}")

    def prefill(self, cmd: SendPrefill) -> Call:
        return self._wait("p:prefill")

    def start_handoff(self, sid: str) -> Call:
        return self._wait("handoff")

    def take_over(self, cmd: TakeOver) -> Call:
        return self._wait("md:take_over")

    async def close(self, *, finished: bool) -> None:
        self.closed = finished


def drive(calls: Calls, commands: list[Any]) -> tuple[LegDriver, Cluster, dict[str, int]]:
    """The commands on a fresh driver; the run's tasks still running afterwards, by role."""

    async def main() -> tuple[LegDriver, Cluster, dict[str, int]]:
        cluster = Cluster()
        driver = LegDriver(LegRun(cluster, asyncio.get_running_loop().time() + 10), calls)
        for cmd in commands:
            driver.execute(cmd)
            await asyncio.sleep(0)
        running = {r.value: len(driver.run.tasks.running(role=r)) for r in (Role.P, Role.RLD, Role.MD)}
        await driver.close(finished=True)
        for task in driver.run.tasks:
            task.cancel()
        await asyncio.gather(*driver.run.tasks, return_exceptions=True)
        return driver, cluster, running

    return asyncio.run(main())


def relay_run() -> list[Any]:
    return [
        SendPrefill(LEG, True, True, False),
        OpenStream(Role.RLD, LEG),
        OpenStream(Role.MD, LEG),
        StartHandoff(LEG.sid),
        TakeOver(LEG, 5, (7, 8), True),
    ]


def test_each_command_starts_its_call_and_rld_holds_a_slot() -> None:
    calls = Calls(frozenset({TaskKind.STREAM}))
    _, cluster, running = drive(calls, relay_run())
    assert calls.started == ["p:prefill", "rld:stream", "md:prime", "handoff", "md:take_over"]
    assert cluster.rld_active == 1 and running == {"p": 1, "rld": 1, "md": 2}
    assert calls.closed is True  # the teardown is the engine's


def test_cancel_streams_ends_what_the_engine_calls_streams() -> None:
    only_streams = Calls(frozenset({TaskKind.STREAM}))  # the reference engine: a take-over is unary
    _, _, running = drive(only_streams, [*relay_run(), CancelStreams(Role.MD), CancelStreams(Role.RLD)])
    assert running == {"p": 1, "rld": 0, "md": 2}  # MD's prime and take-over are not streams there
    everything = Calls(frozenset({TaskKind.STREAM, TaskKind.PRIME, TaskKind.TAKE_OVER}))  # vLLM
    _, _, running = drive(everything, [*relay_run(), CancelStreams(Role.MD)])
    assert running == {"p": 1, "rld": 1, "md": 0}


def test_rld_slot_released_and_handoff_detached() -> None:
    calls = Calls(frozenset({TaskKind.STREAM}))
    driver, cluster, _ = drive(calls, [*relay_run(), ReleaseRldSlot(), DetachHandoff()])
    assert cluster.rld_active == 0
    assert driver.run.tasks.latest(TaskKind.HANDOFF, LEG.sid) is None  # no longer the run's to cancel
    assert driver.run.tasks.latest(TaskKind.PRIME, LEG.sid) is not None


def test_a_stream_no_role_can_take_ends_at_once_without_a_slot() -> None:
    calls = Calls(frozenset({TaskKind.STREAM}), rld=False)

    async def main() -> tuple[Any, int]:
        cluster = Cluster()
        driver = LegDriver(LegRun(cluster, asyncio.get_running_loop().time() + 10), calls)
        driver.execute(OpenStream(Role.RLD, LEG))
        return driver.inbox.get_nowait(), cluster.rld_active

    ended, slots = asyncio.run(main())
    assert ended == StreamEnded(LEG.sid, Role.RLD, StreamClosed(StreamEnd.FAILED, "no_rld_beside_p"), None)
    assert slots == 0 and calls.started == []
