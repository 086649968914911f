"""The router's side: follow every member under the prefix, keep the last view when etcd is away.

Lifecycle of ``MembershipWatcher``: ``start()`` runs a task that, per session, reads the whole
prefix (one ``Snapshot`` at revision R), watches from R + 1, and probes etcd every ``probe_every_s``
(a watch on a silent or hung connection says nothing, a probe does). Any failure: the view is
marked stale but keeps its members, the session is dropped, and the next one starts with a new
snapshot, whose difference to the old view arrives as ordinary changes. Changes go to ``on_change``
(called in the event loop, must not block) and to every ``changes()`` iterator. ``close()`` ends it.
The bookkeeping itself is ``pddlink.membership.view.MembershipView``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import aetcd

from pddlink.errors import DeadlineExceeded, LocalError
from pddlink.membership.etcd import ETCD_ERRORS, EtcdConfig, EtcdSession
from pddlink.membership.record import MemberRecord, MembershipKeys
from pddlink.membership.view import (
    KeyDeleted,
    KeyPut,
    MembershipChange,
    MembershipHealth,
    MembershipView,
    Snapshot,
    StoreEvent,
)


class WatchEnded(LocalError):
    """etcd ended the watch stream without an error (it was cancelled on the server)."""


_END = None  # closes every changes() iterator
_RETRY_ERRORS: tuple[type[BaseException], ...] = (*ETCD_ERRORS, WatchEnded)


class ChangeStream:
    """An async iterator over membership changes; subscribed from its creation, so no change between
    ``changes()`` and the first ``anext`` is lost."""

    def __init__(self, queues: list[asyncio.Queue[MembershipChange | None]]) -> None:
        self._queue: asyncio.Queue[MembershipChange | None] = asyncio.Queue()
        self._queues = queues
        queues.append(self._queue)

    def __aiter__(self) -> ChangeStream:
        return self

    async def __anext__(self) -> MembershipChange:
        change = await self._queue.get()
        if change is _END:
            self.close()
            raise StopAsyncIteration
        return change

    def close(self) -> None:
        if self._queue in self._queues:
            self._queues.remove(self._queue)


class MembershipWatcher:
    def __init__(
        self,
        etcd: EtcdConfig,
        keys: MembershipKeys,
        *,
        on_change: Callable[[MembershipChange], None] | None = None,
        probe_every_s: float = 1.0,
        stale_after_s: float = 3.0,
    ) -> None:
        self.etcd, self.keys = etcd, keys
        self.view = MembershipView(keys, stale_after_s=stale_after_s)
        self.probe_every_s = probe_every_s
        self._on_change = on_change
        self._queues: list[asyncio.Queue[MembershipChange | None]] = []
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- what the router reads -------------------------------------------------------------------

    @property
    def members(self) -> Mapping[str, MemberRecord]:
        return self.view.members

    @property
    def stale(self) -> bool:
        return self.view.stale(self._now())

    @property
    def last_ok_s(self) -> float | None:
        """The event loop's clock (``loop.time()``) when etcd last answered; None before the first sync."""
        return self.view.last_ok_s

    @property
    def error_count(self) -> int:
        return self.view.error_count

    @property
    def malformed_count(self) -> int:
        return self.view.malformed_count

    def health(self) -> MembershipHealth:
        return self.view.health(self._now())

    def changes(self) -> ChangeStream:
        """Every change from this call on, until ``close()`` of the watcher or of the stream."""
        return ChangeStream(self._queues)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"membership {self.keys}")

    async def wait_synced(self, timeout_s: float) -> None:
        """Until the first snapshot is in; ``DeadlineExceeded`` after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._synced.wait()
        except TimeoutError:
            raise DeadlineExceeded(
                f"no membership from etcd within {timeout_s} s: {self.view.last_error}"
            ) from None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for queue in list(self._queues):
            queue.put_nowait(_END)

    async def __aenter__(self) -> MembershipWatcher:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the sessions ----------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _run(self) -> None:
        attempt = 0
        while True:
            session = EtcdSession(self.etcd, attempt)
            try:
                await self._follow(session)
            except* _RETRY_ERRORS as group:
                exc = group.exceptions[0]
                self.view.mark_error(self._now(), f"{session.endpoint}: {type(exc).__name__}: {exc}")
            finally:
                await session.close()
            attempt += 1
            await asyncio.sleep(self.etcd.retry_interval_s)

    async def _follow(self, session: EtcdSession) -> None:
        prefix = self.keys.members_prefix
        got = await session.call(session.client.get_prefix(prefix))
        revision = int(got.header.revision)
        self._apply(Snapshot(tuple((bytes(kv.key), bytes(kv.value)) for kv in got.kvs), revision))
        self._synced.set()
        watch = await session.call(session.client.watch_prefix(prefix, start_revision=revision + 1))
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._probe(session))
            await self._consume(watch)
            raise WatchEnded("the watch stream ended")

    async def _consume(self, watch: aetcd.Watch) -> None:
        async for event in watch:
            key, revision = bytes(event.kv.key), int(event.kv.mod_revision)
            if event.kind == aetcd.EventKind.PUT:
                self._apply(KeyPut(key, bytes(event.kv.value), revision))
            else:
                self._apply(KeyDeleted(key, revision))
            self.view.mark_ok(self._now())

    async def _probe(self, session: EtcdSession) -> None:
        # a linearizable read: a member cut off from its cluster's leader fails it (a serializable
        # read, and a watch, would go on answering from that member's old data)
        while True:
            await asyncio.sleep(self.probe_every_s)
            await session.call(session.client.get(self.keys.members_prefix))
            self.view.mark_ok(self._now())

    def _apply(self, event: StoreEvent) -> None:
        for change in self.view.apply(event, self._now()):
            if self._on_change is not None:
                self._on_change(change)
            for queue in self._queues:
                queue.put_nowait(change)
