"""One established link to a peer, whatever carries it: control messages, requests, transfer routing.

A ``PeerSession`` sits on top of a transport's connections once the hello handshake (and TLS
identity check) has passed. It owns the control channel's semantics, shared by TCP and QUIC:

- control messages from the peer go to ``Handlers.on_message``; a returned reply is sent back;
- ``request(msg)`` waits for the matching answer (Ping->Pong by nonce, Reserve->ReserveAnswer and
  Error by request id, IndexSnapshotRequest->IndexSnapshot in order), always under a timeout;
- transfer messages (begin, chunk, ack, resume, end, abort) go to the transfer driver registered
  for their ``transfer_id`` (``transfers.py``); a begin for an unknown id starts a receive.

The transport subclass provides ``send_control(msg)`` and the data lanes chunks travel on.
Lifecycle: established -> ``close()`` (or the control channel is lost: every pending request and
every transfer fails with PEER_UNREACHABLE, unless the transport reconnects it).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from pddlink.errors import ErrorCode, LocalError, PddlinkError, RemoteError
from pddlink.transport.base import Handlers, LinkStats, Message
from pddlink.transport.tls import PeerIdentity
from pddlink.wire import (
    Abort,
    Ack,
    Chunk,
    Error,
    IndexSnapshot,
    IndexSnapshotRequest,
    Ping,
    Pong,
    Reserve,
    ReserveAnswer,
    Resume,
    TransferBegin,
    TransferEnd,
)

log = logging.getLogger(__name__)
TRANSFER_MESSAGES = (TransferBegin, Chunk, Ack, Resume, TransferEnd, Abort)
Key = tuple[str, object]


def _request_key(message: Message) -> Key | None:
    if isinstance(message, Ping):
        return ("pong", message.nonce)
    if isinstance(message, Reserve):
        return ("reserve", message.request_id)
    if isinstance(message, IndexSnapshotRequest):
        return ("snapshot", None)
    return None


def _reply_key(message: Message) -> Key | None:
    if isinstance(message, Pong):
        return ("pong", message.nonce)
    if isinstance(message, ReserveAnswer):
        return ("reserve", message.request_id)
    if isinstance(message, IndexSnapshot):
        return ("snapshot", None)
    return None


class PeerSession:
    """Control-channel semantics of one link (see module docstring). Subclassed per transport."""

    transport_name = "?"

    def __init__(self, peer: PeerIdentity, handlers: Handlers) -> None:
        self.peer = peer
        self.handlers = handlers
        self._pending: dict[Key, list[asyncio.Future[Message]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.gave_up = False  # a connection the link needs could not be reopened: dial a new link
        self.transfer_router: Callable[[Message], None] | None = None

    @property
    def usable(self) -> bool:
        """False once the link is closed or has given up reopening what it needs; its owner then
        drops it and dials a new one (``sidecar.peers.KVPeer``)."""
        return not self.closed and not self.gave_up

    # -- provided by the transport -------------------------------------------------------------

    def send_control(self, message: Message) -> None:
        raise NotImplementedError

    def stats(self) -> LinkStats:
        raise NotImplementedError

    # -- control messages ----------------------------------------------------------------------

    async def control_ready(self, timeout_s: float) -> None:
        """Wait until the control channel can carry a message (it may be reconnecting)."""

    async def send_message(self, message: Message, *, timeout_s: float = 10.0) -> None:
        if self.closed:
            raise LocalError("link is closed", code=ErrorCode.PEER_UNREACHABLE)
        await self.control_ready(timeout_s)
        self.send_control(message)

    async def request(self, message: Message, *, timeout_s: float) -> Message:
        key = _request_key(message)
        if key is None:
            raise LocalError(f"{type(message).__name__} expects no reply", code=ErrorCode.BAD_REQUEST)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        await self.control_ready(timeout_s)
        future: asyncio.Future[Message] = loop.create_future()
        self._pending.setdefault(key, []).append(future)
        timeout_s = max(0.0, end - loop.time())
        try:
            self.send_control(message)
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            raise LocalError(
                f"no answer to {type(message).__name__} within {timeout_s} s",
                code=ErrorCode.DEADLINE_EXCEEDED,
            ) from None
        finally:
            waiters = self._pending.get(key, [])
            if future in waiters:
                waiters.remove(future)
            if not waiters:
                self._pending.pop(key, None)

    def on_control(self, message: Message) -> None:
        """Entry for every message received on the control channel (and transfer messages)."""
        if isinstance(message, TRANSFER_MESSAGES):
            if self.transfer_router is not None:
                self.transfer_router(message)
            return
        if isinstance(message, Ping):
            self.send_control(Pong(message.nonce, message.sent_ns, message.sent_ns))
            return
        key = _reply_key(message)
        if key is None and isinstance(message, Error) and message.request_id:
            key = ("reserve", message.request_id)
        if key is not None and self._resolve(key, message):
            return
        if self.handlers.on_message is not None:
            self.spawn(self._handle(message))

    def _resolve(self, key: Key, message: Message) -> bool:
        waiters = self._pending.get(key)
        if not waiters:
            return False
        future = waiters.pop(0)
        if not future.done():
            if isinstance(message, Error):
                future.set_exception(RemoteError(message.reason, code=message.code))
            else:
                future.set_result(message)
        return True

    async def _handle(self, message: Message) -> None:
        assert self.handlers.on_message is not None
        try:
            reply = self.handlers.on_message(self.peer, message)
            if inspect.isawaitable(reply):
                reply = await reply
        except PddlinkError as exc:
            request_id = getattr(message, "request_id", "")
            reply = Error(exc.code, exc.message[:1024], request_id if isinstance(request_id, str) else "")
        if reply is not None and not self.closed:
            self.send_control(reply)

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("handler for %s failed", self.peer, exc_info=task.exception())

    def fail_pending(self, error: PddlinkError) -> None:
        for waiters in self._pending.values():
            for future in waiters:
                if not future.done():
                    future.set_exception(error)
        self._pending.clear()

    async def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
