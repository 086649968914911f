"""Opening and accepting pddlink TCP connections: TCP + TLS 1.3, then the hello handshake.

Every connection of a link starts the same way: TCP connect (per-socket congestion control), TLS
with both certificates verified against the CA, then ``pddlink.wire.Handshake``. The hello's
(role, peer_id) must equal the identity in the peer's certificate, and on the connecting side the
identity we meant to reach; otherwise the connection is refused (``HelloRefuse`` with AUTH on the
accepting side, ``AuthError`` on the connecting side) before any KV moves.

Which connection is which travels in the hello's capabilities: ``session:<token>`` opens (or, after
a reconnect, re-opens) the control connection of a link, ``join:<token>`` adds a data connection to
it. The token is random per link (128 bits); with TLS it is only honoured for the same identity.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from pddlink.errors import ErrorCode, LocalError, PddlinkError
from pddlink.transport.base import LinkOptions, Message
from pddlink.transport.framing import ConnectionLost, FrameConnection
from pddlink.transport.tls import AuthError, PeerIdentity, check_peer, identity_from_der
from pddlink.wire import Handshake, HandshakeConfig, Hello, HelloRefuse
from pddlink.wire.frame import WIRE_VERSION

SESSION_CAP, JOIN_CAP = "session:", "join:"


@dataclass(frozen=True, slots=True)
class Greeting:
    """What a handshake established: who the peer is and what the connection is for."""

    peer: PeerIdentity
    kind: str  # "session" (control) or "join" (data)
    token: str


class Inbox:
    """Messages of one connection, queued until an owner takes the connection over."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self.owner: Callable[[FrameConnection, Message], None] | None = None
        self.on_lost: Callable[[FrameConnection, BaseException | None], None] | None = None
        self.capabilities: frozenset[str] = frozenset()  # agreed in the hello, once it passed

    def message(self, conn: FrameConnection, msg: Message) -> None:
        if self.owner is not None:
            self.owner(conn, msg)
        else:
            self.queue.put_nowait(msg)

    def connection_lost(self, conn: FrameConnection, exc: BaseException | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)
        if self.on_lost is not None:
            self.on_lost(conn, exc)

    async def get(self, timeout_s: float) -> Message:
        getter = asyncio.ensure_future(self.queue.get())
        try:
            done, _ = await asyncio.wait(
                {getter, self.lost}, timeout=max(timeout_s, 0.0), return_when="FIRST_COMPLETED"
            )
        finally:  # also when the handshake itself is cancelled: no getter task outlives it
            if not getter.done():
                getter.cancel()
        if getter in done:
            return getter.result()
        if self.lost in done:
            raise ConnectionLost("connection closed during the handshake")
        raise LocalError("handshake timed out", code=ErrorCode.DEADLINE_EXCEEDED)


def new_connection(options: LinkOptions) -> tuple[FrameConnection, Inbox]:
    inbox = Inbox()
    conn = FrameConnection(
        inbox.message,
        inbox.connection_lost,
        congestion_control=options.congestion_control,
        write_high_water_bytes=options.write_high_water_bytes,
        max_payload_bytes=max(options.chunk_bytes, 64 << 20),  # the sender picks the chunk size
        idle_timeout_s=options.idle_timeout_s,
        pacing_bytes_per_s=options.stripe_pacing_bytes_per_s,
    )
    conn.tag = inbox
    return conn, inbox


def _certified(conn: FrameConnection, tls: bool) -> PeerIdentity | None:
    return identity_from_der(conn.peer_certificate_der()) if tls else None


async def _drive(hs: Handshake, conn: FrameConnection, inbox: Inbox) -> PeerIdentity:
    for msg in hs.messages_to_send():
        conn.send(msg)
    while not hs.done:
        msg = await inbox.get(hs.deadline - time.monotonic())
        hs.receive(msg, time.monotonic())
        for out in hs.messages_to_send():
            conn.send(out)
    if hs.error is not None:
        raise hs.error
    assert hs.peer is not None
    inbox.capabilities = hs.capabilities
    return PeerIdentity(hs.peer.role, hs.peer.peer_id)


async def open_connection(
    host: str,
    port: int,
    *,
    config: HandshakeConfig,
    ssl_context: ssl.SSLContext | None,
    expected_peer: PeerIdentity | None,
    options: LinkOptions,
) -> tuple[FrameConnection, Inbox, PeerIdentity]:
    """Connect, authenticate and greet; returns the connection, its inbox and the peer's identity."""
    loop = asyncio.get_running_loop()
    conn, inbox = new_connection(options)
    try:
        await asyncio.wait_for(
            loop.create_connection(lambda: conn, host, port, ssl=ssl_context), options.connect_timeout_s
        )
    except (OSError, TimeoutError, ssl.SSLError) as exc:
        raise LocalError(f"cannot connect to {host}:{port}: {exc}", code=ErrorCode.PEER_UNREACHABLE) from exc
    try:
        certified = _certified(conn, ssl_context is not None)
        if certified is not None:
            check_peer(certified, expected=expected_peer)
        peer = await _drive(Handshake(config, initiator=True, now=time.monotonic()), conn, inbox)
        if certified is not None:
            check_peer(certified, claimed=peer)
        elif expected_peer is not None and expected_peer != peer:
            raise AuthError(f"expected peer {expected_peer}, it says it is {peer}")
    except BaseException as exc:
        # also when the caller gives the connect up mid-handshake (a deadline's cancel): the
        # socket closes with it, not whenever the collector finds it (one open socket per attempt
        # through a WAN outage)
        conn.abort(exc)
        if isinstance(exc, OSError):
            raise LocalError(
                f"connection to {host}:{port} failed: {exc}", code=ErrorCode.PEER_UNREACHABLE
            ) from exc
        raise
    return conn, inbox, peer


async def accept_connection(
    conn: FrameConnection, inbox: Inbox, *, config: HandshakeConfig, tls: bool, timeout_s: float
) -> Greeting:
    """Answer the hello of a connection that reached us; refuse a version, scheme or identity problem."""
    hello = await inbox.get(timeout_s)
    if not isinstance(hello, Hello):
        conn.send(
            HelloRefuse(ErrorCode.PROTOCOL, f"expected Hello, got {type(hello).__name__}", WIRE_VERSION)
        )
        raise LocalError("peer did not start with Hello", code=ErrorCode.PROTOCOL)
    try:
        claimed = PeerIdentity(hello.role, hello.peer_id)
        certified = _certified(conn, tls)
        if certified is not None:
            check_peer(certified, claimed=claimed)
    except PddlinkError as exc:
        conn.send(HelloRefuse(ErrorCode.AUTH, exc.message[:1024], WIRE_VERSION))
        raise AuthError(exc.message) from exc
    hs = Handshake(config, initiator=False, now=time.monotonic())
    hs.receive(hello, time.monotonic())
    for out in hs.messages_to_send():
        conn.send(out)
    if hs.error is not None:
        raise hs.error
    inbox.capabilities = hs.capabilities
    for cap in hello.capabilities:
        for kind, prefix in (("session", SESSION_CAP), ("join", JOIN_CAP)):
            if cap.startswith(prefix):
                return Greeting(claimed, kind, cap.removeprefix(prefix))
    conn.send(HelloRefuse(ErrorCode.PROTOCOL, "hello names no session", WIRE_VERSION))
    raise LocalError("hello names no session", code=ErrorCode.PROTOCOL)
