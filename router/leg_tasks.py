"""One router run's calls on the roles as asyncio tasks, each under a typed key (``TaskKey``).

The run's leg driver (``router.leg_driver``) keeps its tasks, and those its engine's calls start,
in a ``LegTasks``. A key says what the call is (``TaskKind``), the role it talks to and which of the
run's legs it serves (numbered 1, 2, ... as the driver first meets their sids: ``number``); its
``name`` ("md1", "p1", "md1h", "handoff", "takeover") is what ``LegCrashed`` and the log call it.
``spawn`` starts a call and watches it (``watch_leg``): one that dies of an exception posts
``LegCrashed`` to the run's inbox at once. ``running`` finds the calls still under way by role and
kind, for ``CancelStreams`` and the driver's teardown; ``forget`` lets go of calls that are no
longer the run's (a detached handoff), so the teardown leaves them alone. Every other task spawned
stays listed, finished or not, until the driver's ``close`` has drained them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Coroutine, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from pddlink.lifecycle import LegCrashed, RunEvent
from pddlink.roles import Role

T = TypeVar("T")

log = logging.getLogger(__name__)


class TaskKind(StrEnum):
    """What a run's call does."""

    STREAM = "stream"  # a role's token stream (RLD's or MD's Attach, a streaming completion)
    PRIME = "prime"  # vLLM relay leg: MD loads the prompt's KV and waits for the handoff
    PREFILL = "prefill"  # P's prefill (and its shipment)
    HANDOFF = "handoff"  # RLD hands the request to MD
    TAKE_OVER = "take_over"  # MD takes over from the tokens streamed so far (RLD lost)
    EXTEND = "extend"  # vLLM: MD continues after the ids RLD handed over


FIXED_NAMES = {TaskKind.HANDOFF: "handoff", TaskKind.TAKE_OVER: "takeover"}
SUFFIXES = {TaskKind.EXTEND: "h"}


@dataclass(frozen=True, slots=True)
class TaskKey:
    """One call of a run: its kind, the role it talks to (None: the router's own, the handoff)
    and the number of the leg it serves."""

    kind: TaskKind
    role: Role | None
    leg: int

    def __post_init__(self) -> None:
        if self.leg < 1:
            raise ValueError(f"leg numbers start at 1, not {self.leg}")
        if self.role is None and self.kind not in FIXED_NAMES:
            raise ValueError(f"a {self.kind} call talks to a role")

    @property
    def name(self) -> str:
        fixed = FIXED_NAMES.get(self.kind)
        if fixed is not None:
            return fixed
        assert self.role is not None
        return f"{self.role.value}{self.leg}{SUFFIXES.get(self.kind, '')}"


def watch_leg(task: asyncio.Task[Any], sid: str, name: str, inbox: asyncio.Queue[RunEvent]) -> None:
    """When ``task`` (one call of leg ``sid``) dies of an exception, ``LegCrashed`` goes to the run's
    inbox at once: every exception its code does not turn into an event itself (cancellation is
    the driver's own doing and posts nothing)."""

    def ended(t: asyncio.Task[Any]) -> None:
        if t.cancelled() or t.exception() is None:
            return
        exc = t.exception()
        assert exc is not None
        log.error("request %s: %s raised", sid, name, exc_info=exc)
        inbox.put_nowait(LegCrashed.of(sid, name, exc))

    task.add_done_callback(ended)


class LegTasks:
    """A run's tasks in the order spawned, each under its ``TaskKey``; see the module docstring."""

    def __init__(self, inbox: asyncio.Queue[RunEvent]) -> None:
        self.inbox = inbox
        self._tasks: list[tuple[TaskKey, asyncio.Task[Any]]] = []
        self._numbers: dict[str, int] = {}

    def number(self, sid: str) -> int:
        """Leg ``sid``'s number: 1 for the first sid met, then 2, ..."""
        return self._numbers.setdefault(sid, len(self._numbers) + 1)

    def spawn(
        self, kind: TaskKind, role: Role | None, sid: str, coro: Coroutine[Any, Any, T]
    ) -> asyncio.Task[T]:
        """Start ``coro`` as leg ``sid``'s ``kind`` call on ``role``, keyed with the leg's number."""
        key = TaskKey(kind, role, self.number(sid))
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append((key, task))
        watch_leg(task, sid, key.name, self.inbox)
        return task

    def running(
        self, *, role: Role | None = None, kinds: Collection[TaskKind] | None = None
    ) -> list[asyncio.Task[Any]]:
        """The tasks not done yet, oldest first, of ``role`` and ``kinds`` (None: any)."""
        return [
            task
            for key, task in self._tasks
            if not task.done() and (role is None or key.role is role) and (kinds is None or key.kind in kinds)
        ]

    def latest(self, kind: TaskKind, sid: str) -> asyncio.Task[Any] | None:
        """Leg ``sid``'s most recent ``kind`` call, done or not (None: it has none)."""
        number = self._numbers.get(sid)
        found = [task for key, task in self._tasks if key.kind is kind and key.leg == number]
        return found[-1] if found else None

    def cancel(self, *, role: Role, kinds: Collection[TaskKind] | None = None) -> None:
        for task in self.running(role=role, kinds=kinds):
            task.cancel()

    def forget(self, kind: TaskKind) -> None:
        """Stop keeping ``kind``'s tasks: they run on, but are no longer the run's to cancel."""
        self._tasks = [(key, task) for key, task in self._tasks if key.kind is not kind]

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        """Every task kept, done or not, oldest first."""
        return iter([task for _, task in self._tasks])
