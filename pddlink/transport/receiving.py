"""The accepting side of one link: its connections, control messages and incoming transfers.

A ``ReceivingSession`` is created by a listener for the first (control) connection of a peer's
link and lives until the listener closes or the peer stays away longer than
``LinkOptions.idle_timeout_s``. Every connection attached to it is a lane: acks and resume answers go
back on the lane the sender used. Control messages go to ``Handlers.on_message``; ``send_message``
answers on the control connection, so a server can push messages (handoffs) to a connected peer.

Transfers: the first message of an unknown transfer id starts a ``TransferReceiver``; on completion
``Handlers.on_transfer`` gets a ``ReceivedTransfer`` with the chunk buffers in order, on failure
``Handlers.on_transfer_failed`` gets the reason. Finished receivers are kept for
``_KEEP_FINISHED_S`` so a sender that resumes after losing the final echo still gets it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable
from typing import Any

from pddlink.errors import ErrorCode, LocalError, PddlinkError
from pddlink.transfer.config import TransferConfig
from pddlink.transfer.receiver import TransferReceiver
from pddlink.transport.base import Handlers, LinkOptions, LinkStats, Message, ReceivedTransfer, TransferResult
from pddlink.transport.session import PeerSession
from pddlink.transport.tls import PeerIdentity
from pddlink.transport.transfers import Lanes, ReceiveDriver
from pddlink.wire import TransferBegin

log = logging.getLogger(__name__)
_KEEP_FINISHED_S = 60.0
_MAX_FINISHED = 1024


class ReceivingSession(PeerSession):
    """See module docstring. ``attach`` is called by the transport for each authenticated connection."""

    def __init__(self, peer: PeerIdentity, handlers: Handlers, options: LinkOptions, transport: str) -> None:
        super().__init__(peer, handlers)
        self.transport_name = transport
        self.options = options
        self.lanes = Lanes()
        self._control: Any = None
        self._conns: dict[int, Any] = {}
        self._receivers: dict[int, ReceiveDriver] = {}
        self._bytes_received_retired = 0
        self._gone: asyncio.TimerHandle | None = None
        backoff = sum(options.reconnect_backoff_s * 2**i for i in range(options.reconnect_attempts))
        self._grace_s = backoff + options.connect_timeout_s
        self._config = TransferConfig(
            chunk_bytes=options.chunk_bytes, window_bytes=options.window_bytes, assemble=False
        )

    def attach(self, conn: Any, inbox: Any, *, control: bool) -> None:
        """Take over a connection: ``inbox.owner`` / ``inbox.on_lost`` protocol of ``tcp_conn.Inbox``."""
        lane_id = self.lanes.add(conn)
        self._conns[lane_id] = conn
        if self._gone is not None:
            self._gone.cancel()
            self._gone = None
        if control:
            self._control = conn
        inbox.owner = lambda c, m: self.receive(m, lane_id)
        inbox.on_lost = lambda c, exc: self.detach(lane_id)
        while not inbox.queue.empty():
            self.receive(inbox.queue.get_nowait(), lane_id)
        if conn.lost:
            self.detach(lane_id)

    def detach(self, lane_id: int) -> None:
        conn = self._conns.pop(lane_id, None)
        if conn is not None:
            self._bytes_received_retired += conn.bytes_received
        if conn is not None and conn is self._control:
            self._control = None
        self.lanes.remove(lane_id)
        if not self._conns and not self.closed:
            # the peer may reconnect (same token) within its reconnect window; after that, forget it
            self._gone = asyncio.get_running_loop().call_later(self._grace_s, self._expire)

    def _expire(self) -> None:
        if not self._conns and not self.closed:
            self.spawn(self.close())

    @property
    def connected(self) -> bool:
        """Whether the peer's control connection is up (server pushes need it)."""
        return self._control is not None and not self._control.lost

    def receive(self, message: Message, lane_id: int) -> None:
        transfer_id = getattr(message, "transfer_id", None)
        if transfer_id is None:
            self.on_control(message)
            return
        driver = self._receivers.get(transfer_id)
        if driver is None:
            driver = self._new_receiver(transfer_id)
        driver.receive(message, lane_id)

    def _new_receiver(self, transfer_id: int) -> ReceiveDriver:
        self._forget_finished()
        receiver = TransferReceiver(transfer_id, config=self._config, now=time.monotonic())
        driver = ReceiveDriver(
            receiver,
            self.lanes,
            lambda receiver, chunks, seconds: self._complete(receiver, chunks, seconds),
            lambda begin, error: self._failed(begin, error),
        )
        self._receivers[transfer_id] = driver
        return driver

    def _forget_finished(self) -> None:
        now = time.monotonic()
        finished = [(d.finished_at, t) for t, d in self._receivers.items() if d.finished_at is not None]
        finished.sort()
        for i, (at, transfer_id) in enumerate(finished):
            if now - at > _KEEP_FINISHED_S or len(finished) - i > _MAX_FINISHED:
                self._receivers.pop(transfer_id).close()

    def _complete(self, receiver: TransferReceiver, chunks: list[memoryview], seconds: float) -> None:
        if self.handlers.on_transfer is not None:
            stats = receiver.stats
            received = ReceivedTransfer(
                self.peer, receiver.begin, chunks, seconds, stats.duplicate_chunks, stats.stale_chunks
            )
            self._call(self.handlers.on_transfer(received))

    def _failed(self, begin: TransferBegin | None, error: PddlinkError) -> None:
        log.warning("transfer from %s failed: %s (%s)", self.peer, error.message, error.code.name)
        if self.handlers.on_transfer_failed is not None:
            self._call(self.handlers.on_transfer_failed(self.peer, begin, error))

    def _call(self, result: Awaitable[None] | None) -> None:
        if inspect.isawaitable(result):
            self.spawn(result)

    # -- Link API (server side) ----------------------------------------------------------------

    def send_control(self, message: Message) -> None:
        if self._control is None or self._control.lost:
            raise LocalError(f"no control connection from {self.peer}", code=ErrorCode.PEER_UNREACHABLE)
        self._control.send(message)

    async def send_transfer(self, begin: Message, payload: Any, *, deadline_s: float) -> TransferResult:
        raise LocalError("transfers go from the connecting side of a link", code=ErrorCode.BAD_REQUEST)

    def stats(self) -> LinkStats:
        received = self._bytes_received_retired + sum(c.bytes_received for c in self._conns.values())
        sent = sum(c.bytes_sent for c in self._conns.values())
        return LinkStats(
            self.transport_name, len(self._conns), sent, received, None, None, self.lanes.lost_total
        )

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._gone is not None:
            self._gone.cancel()
        for driver in self._receivers.values():
            if driver.finished_at is None:
                driver.abort(ErrorCode.CANCELLED, "receiver shutting down")
            driver.close()
        self._receivers.clear()  # nobody resumes into a closed session: its finished ones go too
        self.fail_pending(LocalError("link closed", code=ErrorCode.CANCELLED))
        await self.cancel_tasks()
        for conn in list(self._conns.values()):
            conn.close()
        await asyncio.sleep(0)
