"""``harness.chaos.run.Phases``: holds for a restarted process's baseline (admissions stop, a fault
already due still fires, a hold begins only once the fault in progress is over)."""

from __future__ import annotations

import asyncio
import threading

from harness.chaos.run import Phases
from harness.chaos.schedule import Fault, FaultKind

OUTAGE = Fault(FaultKind.WAN_OUTAGE, 0.5, duration_s=0.0)


async def never(fault: Fault) -> None:
    raise AssertionError("no burst in this schedule")


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0.35)  # past fire's 0.3 s pause


def test_a_hold_stops_admissions_but_not_a_fault_already_due() -> None:
    async def scenario() -> None:
        ph = Phases([OUTAGE], requests=10, concurrency=2)
        fired: list[int] = []
        for k in range(7):  # 5 before the fault's share, then 2 in flight: it is due
            await ph.admit(k)
        await ph.hold()
        admitting = asyncio.ensure_future(ph.admit(7))
        task = asyncio.ensure_future(ph.fire(lambda f: fired.append(ph.admitted), never))
        await asyncio.wait_for(task, 2.0)
        assert fired == [7] and ph.over == 1  # the schedule's timing is kept
        await settle()
        assert not admitting.done() and ph.admitted == 7  # held
        ph.release()
        await asyncio.wait_for(admitting, 2.0)
        assert ph.admitted == 8

    asyncio.run(scenario())


def test_a_hold_waits_for_the_fault_in_progress() -> None:
    async def scenario() -> None:
        ph = Phases([OUTAGE], requests=10, concurrency=2)
        going, done = threading.Event(), threading.Event()

        def apply(fault: Fault) -> None:
            going.set()
            assert done.wait(5.0)

        for k in range(7):
            await ph.admit(k)
        task = asyncio.ensure_future(ph.fire(apply, never))
        await asyncio.to_thread(going.wait, 5.0)
        holding = asyncio.ensure_future(ph.hold())
        await asyncio.sleep(0.2)
        assert not ph.held and not holding.done()  # the outage is still going on
        done.set()
        await asyncio.wait_for(holding, 2.0)
        assert ph.held and ph.over == 1
        await task

    asyncio.run(scenario())
