"""``LegTasks``: a run's calls under typed keys, found again by role and kind, not by name (in memory)."""

from __future__ import annotations

import asyncio

import pytest

from pddlink.lifecycle import LegCrashed, RunEvent
from pddlink.roles import Role
from router.leg_tasks import LegTasks, TaskKey, TaskKind

pytestmark = [pytest.mark.timeout(10)]


async def _forever() -> None:
    await asyncio.Event().wait()


async def _done() -> None:
    return None


async def _raises() -> None:
    raise KeyError("choices")


def test_keys_name_the_calls_as_the_trace_reports_them() -> None:
    assert TaskKey(TaskKind.STREAM, Role.MD, 1).name == "md1"
    assert TaskKey(TaskKind.STREAM, Role.RLD, 2).name == "rld2"
    assert TaskKey(TaskKind.PRIME, Role.MD, 3).name == "md3"
    assert TaskKey(TaskKind.PREFILL, Role.P, 1).name == "p1"
    assert TaskKey(TaskKind.EXTEND, Role.MD, 2).name == "md2h"
    assert TaskKey(TaskKind.HANDOFF, None, 1).name == "handoff"
    assert TaskKey(TaskKind.TAKE_OVER, Role.MD, 4).name == "takeover"
    with pytest.raises(ValueError):
        TaskKey(TaskKind.STREAM, None, 1)
    with pytest.raises(ValueError):
        TaskKey(TaskKind.PREFILL, Role.P, 0)


def test_legs_are_numbered_in_the_order_first_met() -> None:
    tasks = LegTasks(asyncio.Queue())
    assert [tasks.number(s) for s in ("r", "r#2", "r", "r#3", "r#2")] == [1, 2, 1, 3, 2]


def test_running_and_cancel_select_by_role_and_kind_only() -> None:
    async def main() -> None:
        inbox: asyncio.Queue[RunEvent] = asyncio.Queue()
        tasks = LegTasks(inbox)
        md = tasks.spawn(TaskKind.STREAM, Role.MD, "r", _forever())
        rld = tasks.spawn(TaskKind.STREAM, Role.RLD, "r", _forever())
        p = tasks.spawn(TaskKind.PREFILL, Role.P, "r", _forever())
        take = tasks.spawn(TaskKind.TAKE_OVER, Role.MD, "r", _forever())
        finished = tasks.spawn(TaskKind.STREAM, Role.MD, "r#2", _done())
        await asyncio.sleep(0)
        assert finished.done()
        assert tasks.running(role=Role.MD) == [md, take]
        assert tasks.running(role=Role.MD, kinds={TaskKind.STREAM}) == [md]
        assert tasks.running(kinds={TaskKind.PREFILL}) == [p]
        assert list(tasks) == [md, rld, p, take, finished]
        tasks.cancel(role=Role.MD, kinds={TaskKind.STREAM})
        await asyncio.sleep(0)
        assert md.cancelled() and not take.done() and not rld.done() and not p.done()
        tasks.cancel(role=Role.MD)
        await asyncio.sleep(0)
        assert take.cancelled() and tasks.running() == [rld, p]
        for t in (rld, p):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert inbox.empty()  # cancellation is the driver's own doing: no LegCrashed

    asyncio.run(main())


def test_a_call_that_raises_posts_leg_crashed_under_its_name() -> None:
    async def main() -> None:
        inbox: asyncio.Queue[RunEvent] = asyncio.Queue()
        tasks = LegTasks(inbox)
        crashed = tasks.spawn(TaskKind.EXTEND, Role.MD, "r#2", _raises())
        await asyncio.gather(crashed, return_exceptions=True)
        await asyncio.sleep(0)  # the done-callback runs on the loop's next turn
        assert inbox.get_nowait() == LegCrashed("r#2", "md1h", "KeyError: 'choices'")

    asyncio.run(main())


def test_a_forgotten_call_runs_on_outside_the_list() -> None:
    async def main() -> None:
        tasks = LegTasks(asyncio.Queue())
        handoff = tasks.spawn(TaskKind.HANDOFF, None, "r", _forever())
        md = tasks.spawn(TaskKind.STREAM, Role.MD, "r", _forever())
        tasks.forget(TaskKind.HANDOFF)
        assert list(tasks) == [md] and tasks.running() == [md]
        for t in tasks:
            t.cancel()
        await asyncio.sleep(0)
        assert md.cancelled() and not handoff.done()
        handoff.cancel()
        await asyncio.gather(handoff, md, return_exceptions=True)

    asyncio.run(main())
