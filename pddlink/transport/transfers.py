"""Driving ``pddlink.transfer``'s sans-I/O sender and receiver over a set of live lanes.

A *lane* is one path chunks travel on (a striped TCP connection, a QUIC stream); lanes have small
integer ids local to this side. A driver feeds its state machine every input with ``now`` --
messages of its transfer, lanes lost and made, its timer -- and after each input writes what the
machine wants sent on the lane it names, then re-arms the timer. Writes never block: the machine's
byte window bounds what is buffered, and payloads are memoryview slices of the caller's buffer.

``Lanes`` is the shared registry a transport keeps up to date; drivers subscribe to it so that a
lane lost under a transfer triggers resume on the others, and a lane reconnected joins in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container
from typing import Protocol

from pddlink.errors import ErrorCode, InvalidInput, LocalError, PddlinkError, RemoteError
from pddlink.transfer.config import TransferManifest
from pddlink.transfer.events import (
    ChunkReceived,
    TransferAborted,
    TransferCompleted,
    TransferResumed,
    TransferStarted,
)
from pddlink.transfer.receiver import TransferReceiver
from pddlink.transfer.sender import TransferSender
from pddlink.transport.base import Message, TransferResult
from pddlink.transport.framing import ConnectionLost
from pddlink.transport.machine_timer import MachineTimer
from pddlink.wire import TransferBegin

log = logging.getLogger(__name__)


class Lane(Protocol):
    @property
    def lost(self) -> bool: ...

    def send(self, message: Message) -> int: ...


class LaneWatcher(Protocol):
    def lane_made(self, lane_id: int) -> None: ...

    def lane_lost(self, lane_id: int) -> None: ...


class Lanes:
    """The live lanes of one link, and who to tell when they change."""

    def __init__(self) -> None:
        self.live: dict[int, Lane] = {}
        self._next_id = 0
        self._watchers: set[LaneWatcher] = set()
        self.lost_total = 0

    def add(self, lane: Lane) -> int:
        lane_id = self._next_id
        self._next_id += 1
        self.live[lane_id] = lane
        for watcher in list(self._watchers):
            watcher.lane_made(lane_id)
        return lane_id

    def remove(self, lane_id: int) -> None:
        if self.live.pop(lane_id, None) is None:
            return
        self.lost_total += 1
        for watcher in list(self._watchers):
            watcher.lane_lost(lane_id)

    def watch(self, watcher: LaneWatcher) -> None:
        self._watchers.add(watcher)

    def unwatch(self, watcher: LaneWatcher) -> None:
        self._watchers.discard(watcher)

    def send(self, lane_id: int, message: Message) -> bool:
        """Send on a lane; False (and the lane removed) when it turned out to be dead."""
        lane = self.live.get(lane_id)
        if lane is None:
            return False
        try:
            lane.send(message)
        except ConnectionLost:
            self.remove(lane_id)
            return False
        return True


def error_of(event: TransferAborted) -> PddlinkError:
    cls = RemoteError if event.remote else LocalError
    return cls(event.reason, code=event.code)


class SendDriver:
    """One outgoing transfer: a ``TransferSender`` driven over ``lanes`` until it ends.

    ``result`` holds the outcome as data (the result, or the abort event), never an exception:
    an exception kept in the future and raised from it gets a traceback whose frames hold the
    driver (and the caller's payload), a reference cycle the cyclic GC frees only when it next
    runs a full collection, which in a quiet process can be never (issue 16: a P held the KV of
    every transfer that had missed its deadline, 100s of MiB after a burst). ``await_result``
    raises a new error each time instead.
    """

    def __init__(self, sender: TransferSender, lanes: Lanes, on_done: Callable[[SendDriver], None]) -> None:
        self.sender = sender
        self.lanes = lanes
        self._on_done = on_done
        loop = asyncio.get_running_loop()
        self.result: asyncio.Future[TransferResult | TransferAborted] = loop.create_future()
        self._timer = MachineTimer(self._on_timer)
        self._resumes = 0
        self._started = time.monotonic()
        lanes.watch(self)

    @property
    def transfer_id(self) -> int:
        return self.sender.transfer_id

    def start(self) -> None:
        self._pump()

    def receive(self, message: Message) -> None:
        self.sender.receive(message, time.monotonic())
        self._pump()

    def lane_made(self, lane_id: int) -> None:
        self.sender.connection_made(lane_id, time.monotonic())
        self._pump()

    def lane_lost(self, lane_id: int) -> None:
        self.sender.connection_lost(lane_id, time.monotonic())
        self._pump()

    def cancel(self, code: ErrorCode, reason: str) -> None:
        self.sender.abort(code, reason, time.monotonic())
        self._pump()

    def _pump(self) -> None:
        sm = self.sender
        now = time.monotonic()
        for out in sm.messages_to_send(now):
            if not self.lanes.send(out.conn_id, out.message):
                return  # lane_lost re-entered _pump with the new generation
        while (event := sm.next_event()) is not None:
            if isinstance(event, TransferResumed):
                self._resumes += 1
                log.info("transfer %d resumed: generation %d, %d chunks left", event.transfer_id,
                         event.generation, event.chunks_to_send)  # fmt: skip
            elif isinstance(event, TransferCompleted):
                self._finish(self._result())
            elif isinstance(event, TransferAborted):
                self._finish(event)
        self._arm(sm.get_timer())

    def _result(self) -> TransferResult:
        stats = self.sender.stats
        return TransferResult(
            transfer_id=self.sender.transfer_id,
            bytes=stats.bytes_sent - stats.bytes_resent,
            chunks=self.sender.num_chunks,
            seconds=time.monotonic() - self._started,
            resent_chunks=stats.chunks_resent,
            reconnects=self._resumes,
        )

    def _arm(self, when: float | None) -> None:
        self._timer.arm(None if self.result.done() else when)

    def _on_timer(self, now: float) -> None:
        self.sender.handle_timer(now)
        self._pump()

    def _finish(self, outcome: TransferResult | TransferAborted) -> None:
        self._timer.close()  # no driver <-> timer cycle: the ended driver is freed at once
        self.lanes.unwatch(self)
        if not self.result.done():
            self.result.set_result(outcome)
        self._on_done(self)


class ReceiveDriver:
    """One incoming transfer: a ``TransferReceiver`` driven until it completes or aborts.

    Chunks are kept as the frames' own buffers (``assemble=False``): the handler gets them in index
    order without a copy. A finished receiver stays registered a while (the session keeps it) so a
    sender that lost our ``TransferEnd`` echo and resumes gets the answer again.
    """

    def __init__(
        self,
        receiver: TransferReceiver,
        lanes: Lanes,
        on_complete: Callable[[TransferReceiver, list[memoryview], float], None],
        on_failed: Callable[[TransferBegin | None, PddlinkError], None],
    ) -> None:
        self.receiver = receiver
        self.lanes = lanes
        self._on_complete = on_complete
        self._on_failed = on_failed
        self._chunks: dict[int, memoryview] = {}
        self._timer = MachineTimer(self._on_timer)
        self._started = time.monotonic()
        self.finished_at: float | None = None

    def receive(self, message: Message, lane_id: int) -> None:
        self.receiver.receive(message, lane_id, time.monotonic())
        self._pump()

    def abort(self, code: ErrorCode, reason: str) -> None:
        self.receiver.abort(code, reason, time.monotonic())
        self._pump()

    def _pump(self) -> None:
        sm = self.receiver
        for out in sm.messages_to_send(time.monotonic()):
            self.lanes.send(out.conn_id, out.message)
        while (event := sm.next_event()) is not None:
            if isinstance(event, TransferStarted):
                self._started = time.monotonic()
            elif isinstance(event, ChunkReceived):
                self._chunks[event.index] = event.payload
            elif isinstance(event, TransferCompleted):
                chunks = [self._chunks[i] for i in range(len(self._chunks))]
                self._chunks = {}
                self._done()
                self._on_complete(sm, chunks, time.monotonic() - self._started)
            elif isinstance(event, TransferAborted):
                self._chunks = {}
                self._done()
                self._on_failed(sm.begin, error_of(event))
        self._timer.arm(sm.get_timer())

    def _done(self) -> None:
        self.finished_at = time.monotonic()

    def _on_timer(self, now: float) -> None:
        self.receiver.handle_timer(now)
        self._pump()

    def close(self) -> None:
        self._timer.close()


class TransferIds:
    """Transfer ids of one link: the caller's (from a ``TransferBegin``) or the next free one."""

    def __init__(self) -> None:
        self._next = 1

    def assign(
        self, begin: TransferBegin | TransferManifest, data: memoryview, in_progress: Container[int]
    ) -> tuple[int, int | None]:
        """``(transfer_id, chunk_bytes or None for the link's)``; bad input changes nothing."""
        if isinstance(begin, TransferManifest):
            transfer_id = self._next
            self._next += 1
            return transfer_id, None
        if begin.total_bytes != data.nbytes:
            raise InvalidInput(f"TransferBegin.total_bytes={begin.total_bytes}, payload has {data.nbytes}")
        if begin.transfer_id in in_progress:
            raise InvalidInput(f"transfer {begin.transfer_id} is already in progress on this link")
        self._next = max(self._next, begin.transfer_id + 1)
        return begin.transfer_id, begin.chunk_bytes


async def await_result(driver: SendDriver, deadline_s: float) -> TransferResult:
    """The driver's result; its own deadline fires first, this bound only guards against a bug.
    Cancelling the caller cancels the transfer (the peer is told)."""
    try:
        outcome = await asyncio.wait_for(asyncio.shield(driver.result), deadline_s + 5.0)
    except TimeoutError:
        driver.cancel(ErrorCode.DEADLINE_EXCEEDED, "transfer driver missed its own deadline")
        raise LocalError("transfer did not end by its deadline", code=ErrorCode.DEADLINE_EXCEEDED) from None
    except asyncio.CancelledError:
        driver.cancel(ErrorCode.CANCELLED, "sender cancelled the transfer")
        raise
    if isinstance(outcome, TransferAborted):
        raise error_of(outcome)  # a new error, not one the driver keeps (see SendDriver)
    return outcome
