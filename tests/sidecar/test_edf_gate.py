"""P's engine gate (``sidecar.edf_gate``): the waiter with the earliest deadline gets the next
slot, a cancelled waiter gives up its place, and slots come back whatever happens inside."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.edf_gate import EdfGate


def test_waiters_get_the_slot_by_deadline_not_by_arrival() -> None:
    async def run() -> list[str]:
        gate, order = EdfGate(1), []
        hold = asyncio.Event()

        async def user(name: str, deadline: float) -> None:
            async with gate.slot(deadline):
                order.append(name)
                if name == "first":
                    await hold.wait()

        first = asyncio.create_task(user("first", 50.0))
        await asyncio.sleep(0)
        late = [asyncio.create_task(user(n, d)) for n, d in (("new", 30.0), ("rescue", 10.0), ("mid", 20.0))]
        await asyncio.sleep(0)
        assert gate.queued == 3 and gate.free == 0
        hold.set()
        await asyncio.gather(first, *late)
        assert gate.free == 1 and gate.queued == 0
        return order

    assert asyncio.run(run()) == ["first", "rescue", "mid", "new"]


def test_a_cancelled_waiter_leaves_and_an_error_inside_frees_the_slot() -> None:
    async def run() -> None:
        gate = EdfGate(1)
        hold = asyncio.Event()
        got: list[str] = []

        async def holder() -> None:
            async with gate.slot(1.0):
                await hold.wait()
                raise RuntimeError("engine failed")

        async def user(name: str, deadline: float) -> None:
            async with gate.slot(deadline):
                got.append(name)

        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        gone = asyncio.create_task(user("gone", 0.5))
        kept = asyncio.create_task(user("kept", 5.0))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        hold.set()
        with pytest.raises(RuntimeError):
            await h
        await kept
        assert got == ["kept"] and gate.free == 1
        async with gate.slot(9.0):  # the slot is there at once
            assert gate.free == 0

    asyncio.run(run())


def test_two_slots_run_two_at_once() -> None:
    async def run() -> int:
        gate, busy, peak = EdfGate(2), 0, 0

        async def user(d: float) -> None:
            nonlocal busy, peak
            async with gate.slot(d):
                busy += 1
                peak = max(peak, busy)
                await asyncio.sleep(0.01)
                busy -= 1

        await asyncio.gather(*(user(float(i)) for i in range(6)))
        return peak

    assert asyncio.run(run()) == 2
