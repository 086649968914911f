"""Striped TCP: one control connection plus N data connections per link, TLS 1.3 optional.

The connecting side (``TcpLink``) opens the control connection (hello with ``session:<token>``),
then ``LinkOptions.streams`` data connections (``join:<token>``). Control messages (handoff,
reservations, pings) use the control connection only, so they never queue behind MiB chunks; a
transfer's chunks are striped over the data connections by ``pddlink.transfer``'s sender (each
chunk on the lane with the fewest unacknowledged bytes), acks come back on the lane a chunk used.

A lost data connection triggers resume on the others at once (new generation; acked chunks are not
resent) and a background reconnect of that stripe (``reconnect_attempts`` tries, exponential
backoff), which joins running transfers when it is back. A lost control connection is reopened the
same way with the same token (control messages wait for it within their timeout); the listener
keeps the session for the peer's reconnect window.

The accepting side (``TcpListener``) authenticates every connection, attaches it to its session
by token (with TLS, only for the same certified identity) and runs one receiver per transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import ssl
import time
from collections.abc import Sequence
from typing import ClassVar, TypeVar

from pddlink.errors import ErrorCode, LocalError, PddlinkError
from pddlink.transfer.config import TransferConfig, TransferManifest
from pddlink.transfer.sender import TransferSender
from pddlink.transport import sockopt
from pddlink.transport.base import Buffer, Handlers, LinkOptions, LinkStats, Message, TransferResult
from pddlink.transport.framing import FrameConnection
from pddlink.transport.receiving import ReceivingSession
from pddlink.transport.session import PeerSession
from pddlink.transport.tcp_conn import (
    JOIN_CAP,
    SESSION_CAP,
    Inbox,
    accept_connection,
    new_connection,
    open_connection,
)
from pddlink.transport.tls import PeerIdentity, TlsConfig
from pddlink.transport.transfers import Lanes, SendDriver, TransferIds, await_result
from pddlink.wire import HandshakeConfig, TransferBegin

log = logging.getLogger(__name__)


def transfer_config(options: LinkOptions, chunk_bytes: int | None = None) -> TransferConfig:
    chunk = chunk_bytes or options.chunk_bytes
    return TransferConfig(chunk_bytes=chunk, window_bytes=max(options.window_bytes, chunk), assemble=False)


def manifest_of(begin: TransferBegin | TransferManifest) -> TransferManifest:
    if isinstance(begin, TransferManifest):
        return begin
    return TransferManifest(
        begin.request_id, begin.layout, begin.block_hashes, begin.num_tokens, begin.first_block, begin.codec
    )


def as_buffer(payload: Buffer | Sequence[Buffer]) -> memoryview:
    if isinstance(payload, bytes | bytearray | memoryview):
        return memoryview(payload).cast("B")
    return memoryview(b"".join(payload))  # a sequence is joined once: pass one buffer to avoid the copy


class ConnStats:
    """Byte and TCP_INFO counters over every connection a link ever had."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.retransmits = 0
        self.rtt_s: float | None = None

    def retire(self, conn: FrameConnection) -> None:
        self.bytes_sent += conn.bytes_sent
        self.bytes_received += conn.bytes_received
        info = self._info(conn)
        if info is not None:
            self.retransmits += info.total_retransmits

    @staticmethod
    def _info(conn: FrameConnection) -> sockopt.TcpInfo | None:
        sock = conn.socket()
        return None if sock is None else sockopt.tcp_info(sock)

    def snapshot(
        self, live: Sequence[FrameConnection], transport: str, streams: int, resumes: int
    ) -> LinkStats:
        sent, received, retrans = self.bytes_sent, self.bytes_received, self.retransmits
        rtts = []
        for conn in live:
            sent += conn.bytes_sent
            received += conn.bytes_received
            info = self._info(conn)
            if info is not None:
                retrans += info.total_retransmits
                rtts.append(info.rtt_s)
        rtt = min(rtts) if rtts else self.rtt_s
        return LinkStats(transport, streams, sent, received, retrans, rtt, resumes)


class TcpLink(PeerSession):
    """The connecting side of a striped TCP link (see module docstring)."""

    transport_name = "tcp"

    def __init__(self, peer: PeerIdentity, handlers: Handlers, dial: Dial, options: LinkOptions) -> None:
        super().__init__(peer, handlers)
        self._reset_on_close = False  # reset(): connections end with a TCP reset
        self.options = options
        self.lanes = Lanes()
        self.counters = ConnStats()
        self._dial = dial
        self._control: FrameConnection | None = None
        self._data: dict[int, FrameConnection] = {}
        self._senders: dict[int, SendDriver] = {}
        self._ids = TransferIds()
        self._resumes = 0
        self._control_settled = asyncio.Event()  # set: control is up, or its reconnect gave up
        self._reconnecting_control: asyncio.Task[None] | None = None
        self.transfer_router = self._route

    # -- set-up --------------------------------------------------------------------------------

    def adopt_control(self, conn: FrameConnection, inbox: Inbox) -> None:
        self._control = conn
        self._control_settled.set()
        self._own(conn, inbox, lane=False)

    async def control_ready(self, timeout_s: float) -> None:
        if self._control_settled.is_set() or self._reconnecting_control is None:
            return  # up, or down for good: send_control says which
        with contextlib.suppress(TimeoutError):  # then send_control reports the missing connection
            await asyncio.wait_for(self._control_settled.wait(), timeout_s)

    async def open_stripes(self) -> None:
        await asyncio.gather(*(self._open_stripe() for _ in range(self.options.streams)))

    async def _open_stripe(self) -> None:
        conn, inbox, _ = await self._dial(JOIN_CAP)
        self._own(conn, inbox, lane=True)

    def _own(self, conn: FrameConnection, inbox: Inbox, *, lane: bool) -> None:
        lane_id = self.lanes.add(conn) if lane else None
        if lane_id is not None:
            self._data[lane_id] = conn
        inbox.owner = lambda c, m: self.on_control(m)
        inbox.on_lost = lambda c, exc: self._lost(c, lane_id)
        while not inbox.queue.empty():
            self.on_control(inbox.queue.get_nowait())
        if conn.lost:
            self._lost(conn, lane_id)

    def _lost(self, conn: FrameConnection, lane_id: int | None) -> None:
        self.counters.retire(conn)
        if self.closed:
            return
        if lane_id is None:
            log.warning("control connection to %s lost; reconnecting", self.peer)
            self._control = None
            self._control_settled.clear()
            self._reconnecting_control = asyncio.ensure_future(self._reconnect(control=True))
            self._tasks.add(self._reconnecting_control)
            self._reconnecting_control.add_done_callback(self._control_reconnected)
            return
        self._data.pop(lane_id, None)
        self.lanes.remove(lane_id)
        log.warning("stripe %d to %s lost; %d left, reconnecting", lane_id, self.peer, len(self._data))
        self.spawn(self._reconnect(control=False))

    def _control_reconnected(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._reconnecting_control is task:
            self._reconnecting_control = None
            self._control_settled.set()  # wake waiters: up again, or down for good

    async def _reconnect(self, *, control: bool) -> None:
        for attempt in range(self.options.reconnect_attempts):
            await asyncio.sleep(self.options.reconnect_backoff_s * (2**attempt))
            if self.closed:
                return
            try:
                conn, inbox, _ = await self._dial(SESSION_CAP if control else JOIN_CAP)
            except PddlinkError as exc:
                log.info("reconnect to %s failed: %s", self.peer, exc.message)
                continue
            if control:
                self.adopt_control(conn, inbox)
            else:
                self._own(conn, inbox, lane=True)
            return
        log.warning("gave up reopening a %s connection to %s", "control" if control else "data", self.peer)
        if control or not self._data:
            self.gave_up = True  # no control or no stripe left: the owner dials a new link
        if control:
            self.fail_pending(
                LocalError(f"control connection to {self.peer} lost", code=ErrorCode.PEER_UNREACHABLE)
            )

    # -- Link API ------------------------------------------------------------------------------

    def send_control(self, message: Message) -> None:
        if self._control is None or self._control.lost:
            raise LocalError(f"no control connection to {self.peer}", code=ErrorCode.PEER_UNREACHABLE)
        self._control.send(message)

    async def send_transfer(
        self,
        begin: TransferBegin | TransferManifest,
        payload: Buffer | Sequence[Buffer],
        *,
        deadline_s: float,
    ) -> TransferResult:
        if self.closed:
            raise LocalError("link is closed", code=ErrorCode.PEER_UNREACHABLE)
        data = as_buffer(payload)
        transfer_id, chunk_bytes = self._ids.assign(begin, data, self._senders)
        now = time.monotonic()
        sender = TransferSender(
            transfer_id,
            manifest_of(begin),
            data,
            config=transfer_config(self.options, chunk_bytes),
            deadline=now + deadline_s,
            connections=list(self.lanes.live),
            now=now,
        )
        driver = SendDriver(sender, self.lanes, self._forget_sender)
        self._senders[transfer_id] = driver
        driver.start()
        return await await_result(driver, deadline_s)

    def _forget_sender(self, driver: SendDriver) -> None:
        self._senders.pop(driver.transfer_id, None)

    def _route(self, message: Message) -> None:
        driver = self._senders.get(message.transfer_id)
        if driver is not None:
            driver.receive(message)

    def stats(self) -> LinkStats:
        live = [c for c in (self._control, *self._data.values()) if c is not None]
        snap = self.counters.snapshot(live, "tcp", self.options.streams, self.lanes.lost_total)
        ccs = sorted({c.congestion_control for c in self._data.values()})
        return dataclasses.replace(snap, congestion_control=",".join(ccs) or None)

    def data_connections(self) -> list[FrameConnection]:
        """The live stripes (tests cut one to prove resume)."""
        return list(self._data.values())

    async def reset(self) -> None:
        """Close with a TCP reset on every connection: what the kernel still queues for the peer
        is thrown away, never delivered (``FrameConnection.reset``)."""
        self._reset_on_close = True
        await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for driver in list(self._senders.values()):
            driver.cancel(ErrorCode.CANCELLED, "link closed")
        self.fail_pending(LocalError("link closed", code=ErrorCode.CANCELLED))
        await self.cancel_tasks()
        for conn in (self._control, *self._data.values()):
            if conn is not None:
                conn.reset() if self._reset_on_close else conn.close()
        await asyncio.sleep(0)


class Dial:
    """Opens one more connection of a link (control or stripe) with its token."""

    def __init__(
        self,
        host: str,
        port: int,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        expected_peer: PeerIdentity | None,
        options: LinkOptions,
    ) -> None:
        self.host, self.port, self.options = host, port, options
        self.identity, self.expected_peer = identity, expected_peer
        self.ssl_context: ssl.SSLContext | None = None if tls is None else tls.client_context()
        self.token = secrets.token_hex(16)
        self.capabilities: tuple[str, ...] = ()  # offered in every hello besides the token

    async def __call__(self, kind: str) -> tuple[FrameConnection, Inbox, PeerIdentity]:
        config = HandshakeConfig(
            self.identity.name,
            self.identity.role,
            capabilities=(kind + self.token, *self.capabilities),
            timeout_s=self.options.connect_timeout_s,
        )
        return await open_connection(
            self.host, self.port, config=config, ssl_context=self.ssl_context,
            expected_peer=self.expected_peer, options=self.options,
        )  # fmt: skip


class TcpListener:
    """Accepts links; one ``ReceivingSession`` per connecting peer link (token)."""

    capabilities: tuple[str, ...] = ()  # offered in every hello answer

    def __init__(
        self, identity: PeerIdentity, tls: TlsConfig | None, handlers: Handlers, options: LinkOptions
    ):
        self.identity, self.tls, self.handlers, self.options = identity, tls, handlers, options
        self.server: asyncio.Server | None = None
        self.sessions: dict[str, ReceivingSession] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self.server is not None
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    def links(self) -> list[ReceivingSession]:
        """Peers connected now (their control connection is up)."""
        self._forget_closed()
        return [s for s in self.sessions.values() if s.connected]

    def _forget_closed(self) -> None:
        """Drop the sessions that closed (a peer away past its reconnect window): a server that
        never asks for ``links()`` (MD's KV server beside vLLM) kept every one a reconnecting P left."""
        for token in [t for t, s in self.sessions.items() if s.closed]:
            del self.sessions[token]

    def connection(self) -> FrameConnection:
        conn, inbox = new_connection(self.options)
        task = asyncio.ensure_future(self._greet(conn, inbox))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conn

    async def _greet(self, conn: FrameConnection, inbox: Inbox) -> None:
        config = HandshakeConfig(
            self.identity.name,
            self.identity.role,
            capabilities=self.capabilities,
            timeout_s=self.options.connect_timeout_s,
        )
        try:
            await conn.connected
            greeting = await accept_connection(
                conn, inbox, config=config, tls=self.tls is not None, timeout_s=self.options.connect_timeout_s
            )
        except PddlinkError as exc:
            log.warning("refused a connection: %s", exc.message)
            conn.close()
            return
        self._forget_closed()
        session = self.sessions.get(greeting.token)
        if session is None and greeting.kind == "session":
            session = self.new_session(greeting.peer, inbox)
            self.sessions[greeting.token] = session
        if session is None or session.peer != greeting.peer:
            log.warning("refused a stripe from %s: unknown session", greeting.peer)
            conn.close()
            return
        session.attach(conn, inbox, control=greeting.kind == "session")

    def new_session(self, peer: PeerIdentity, control: Inbox) -> ReceivingSession:
        """The session of a new link; ``control`` is its control connection's inbox."""
        return ReceivingSession(peer, self.handlers, self.options, "tcp")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        for session in list(self.sessions.values()):
            await session.close()
        if self.server is not None:
            await asyncio.wait_for(self.server.wait_closed(), 5.0)


L = TypeVar("L", bound="TcpListener")


async def serve(listener: L, host: str, port: int, tls: TlsConfig | None) -> L:
    """Start accepting connections for ``listener`` (TLS when ``tls`` is given)."""
    ssl_context = None if tls is None else tls.server_context()
    loop = asyncio.get_running_loop()
    listener.server = await loop.create_server(
        listener.connection, host, port, ssl=ssl_context, reuse_address=True, backlog=256
    )
    return listener


class TcpTransport:
    """Registry entry "tcp"."""

    name: ClassVar[str] = "tcp"

    @classmethod
    async def listen(
        cls,
        host: str,
        port: int,
        *,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        handlers: Handlers,
        options: LinkOptions,
    ) -> TcpListener:
        return await serve(TcpListener(identity, tls, handlers, options), host, port, tls)

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        expected_peer: PeerIdentity | None,
        handlers: Handlers,
        options: LinkOptions,
    ) -> TcpLink:
        dial = Dial(host, port, identity, tls, expected_peer, options)
        conn, inbox, peer = await dial(SESSION_CAP)
        dial.expected_peer = peer  # every stripe must reach the same certified peer
        link = TcpLink(peer, handlers, dial, options)
        link.adopt_control(conn, inbox)
        try:
            await link.open_stripes()
        except BaseException:
            await link.close()
            raise
        return link
