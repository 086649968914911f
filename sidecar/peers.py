"""Connections from one sidecar to its peers, opened lazily and reopened after a failure.

``KVPeer``: a ``pddlink.transport.KVClient`` to a peer's KV server (the WAN link to MD, the fast
path to RLD). ``DecoderPeer``: the peer's gRPC Sidecar service, for the token-id handoff. Both
check the peer's certified identity against the one configured for it (``pddlink.serving.grpc_tls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc

from pddlink.errors import ConfigError, DeadlineExceeded, ErrorCode, PddlinkError, RemoteError, Unavailable
from pddlink.serving.grpc_tls import open_channel
from pddlink.serving.rpc import stubs
from pddlink.transport import KVClient, LinkOptions, PeerIdentity, TlsConfig, TransferResult
from pddlink.transport.base import Message
from pddlink.wire import TransferBegin
from sidecar.wan_silence import CallSilence, LinkSilence

T = TypeVar("T")

# a decoder's channel stays connected however long it is idle (gRPC's default drops it after 30
# idle minutes, and the next handoff pays the handshake again, across the WAN)
KEEP_CONNECTED = (("grpc.client_idle_timeout_ms", 2**31 - 1),)


def split_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


class KVPeer:
    def __init__(
        self,
        addr: str,
        *,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        transport: str,
        options: LinkOptions,
        expected_peer: PeerIdentity | None = None,
        silence_floor_s: float | None = None,
    ) -> None:
        """``silence_floor_s``: a WAN link; what waits on it (a dial, ``request``, ``send``) ends
        once the link has been silent for ``sidecar.wan_silence.silence_bound`` with this floor,
        not at its deadline. None: waits end at their deadlines only."""
        self.addr = addr
        self.identity, self.tls, self.transport, self.options = identity, tls, transport, options
        self.expected_peer = expected_peer
        self._client: KVClient | None = None
        self._lock = asyncio.Lock()
        self.transport_name = transport
        self.in_flight_bytes = 0  # KV bytes of the transfers now on this link (pool choice)
        self.redials = 0  # links found closed or given up and dialled anew
        self.silence = (
            None if silence_floor_s is None else LinkSilence(addr, lambda: self._client, silence_floor_s)
        )

    async def _guarded(self, what: str, aw: Awaitable[T]) -> T:
        return await (aw if self.silence is None else self.silence.guard(what, aw))

    async def client(self, deadline: float) -> KVClient:
        live = self._client
        if live is not None and live.usable and not self._lock.locked():
            return live  # connected: nothing to wait on, no watch (every Prefill asks for it)
        return await self._guarded(f"dialling {self.addr}", self._client_now(deadline))

    async def request(self, message: Message, deadline: float) -> Message:
        """A control request (a reservation) answered by the peer before ``deadline``."""
        client = await self.client(deadline)
        timeout_s = max(deadline - time.monotonic(), 0.01)
        return await self._guarded(
            f"{type(message).__name__} to {self.addr}", client.request(message, timeout_s=timeout_s)
        )

    async def _client_now(self, deadline: float) -> KVClient:
        """The link's client, dialled now when there is none or the last one is closed or gave up
        reconnecting (a restarted peer, an outage longer than the reconnect backoff)."""
        async with self._lock:
            if self._client is not None and not self._client.usable:
                stale, self._client = self._client, None
                self.redials += 1
                await _close_quietly(stale, reset=True)  # already dead: this only releases its sockets
            if self._client is None:
                host, port = split_hostport(self.addr)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"no time left to connect to {self.addr}")
                try:
                    self._client = await asyncio.wait_for(
                        KVClient.connect(
                            host,
                            port,
                            identity=self.identity,
                            tls=self.tls,
                            transport=self.transport,
                            expected_peer=self.expected_peer,
                            options=self.options,
                        ),
                        timeout=left,
                    )
                except TimeoutError:
                    raise DeadlineExceeded(f"connecting to {self.addr} outlived the deadline") from None
                except OSError as exc:
                    raise Unavailable(f"{self.addr}: {exc}", code=ErrorCode.PEER_UNREACHABLE) from None
                self.transport_name = self._client.transport
            return self._client

    async def send(self, begin: TransferBegin, payload: memoryview, deadline: float) -> TransferResult:
        """One transfer on this link; a failure that shows the link is lost, gave up or stalled
        closes it (the next use dials anew), any other failure leaves it to the transfers on it."""
        client = await self.client(deadline)
        heard = client.stats().bytes_received
        try:
            return await self._guarded(
                f"transfer to {self.addr}",
                client.send_transfer(begin, payload, deadline_s=max(deadline - time.monotonic(), 0.01)),
            )
        except PddlinkError as exc:
            if redial_after(exc, client, heard):
                await self.drop(client)  # this client only: the link may have been re-dialled since
            raise

    async def drop(self, failed: KVClient | None = None) -> None:
        """Close the link so the next use dials a new one. ``failed``: the client a transfer failed
        on; when the link has been re-dialled since, the new client is kept (a late failure on the
        old one must not close the link every other transfer now uses)."""
        async with self._lock:
            if failed is not None and failed is not self._client:
                return
            client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client, reset=failed is not None)  # a failed link: nothing queued goes out

    def stats(self) -> dict[str, Any]:
        if self._client is None:
            return {"addr": self.addr, "connected": False}
        s = self._client.stats()
        return {
            "addr": self.addr,
            "connected": True,
            "transport": s.transport,
            "streams": s.streams,
            "bytes_sent": s.bytes_sent,
            "retransmits": s.retransmits,
            "rtt_s": s.rtt_s,
            "reconnects": s.reconnects,
            "redials": self.redials,
            **({"silenced": self.silence.silenced} if self.silence is not None else {}),
        }


_LINK_LOST = (ErrorCode.PEER_UNREACHABLE, ErrorCode.UNAVAILABLE)  # not CANCELLED: we closed it


def redial_after(exc: PddlinkError, client: KVClient, heard_before: int) -> bool:
    """Whether a failed transfer's link must be closed and dialled anew: it is lost or gave up, or
    it stalled (nothing at all came back while the transfer ran: after a long outage TCP's
    retransmission backoff can keep a connection silent for tens of seconds). A transfer that
    missed its deadline on a link that answers is not the link's fault: closing it would cancel
    every other transfer on it ("cancelled: link closed")."""
    stalled = exc.code is ErrorCode.DEADLINE_EXCEEDED and client.stats().bytes_received == heard_before
    return exc.code in _LINK_LOST or stalled or not client.usable


async def _close_quietly(client: KVClient, *, reset: bool = False) -> None:
    with contextlib.suppress(TimeoutError, PddlinkError, OSError):
        await asyncio.wait_for(client.close(reset=reset), 1.0)


class KVPeerPool:
    """Several links to one peer (the WAN connection pool): each transfer takes the link with the
    fewest bytes in flight, so a small suffix never queues behind a large one on the same TCP
    connections (head-of-line blocking inside a link)."""

    def __init__(self, links: list[KVPeer]) -> None:
        if not links:
            raise ConfigError("a WAN connection pool needs at least one link")
        self.links = links

    async def connect_all(self, timeout_s: float) -> int:
        """Open every link now (a link first opened under load can lose its SYN in a full queue and
        wait out the 1 s SYN timeout); returns how many are up. Failures are retried on use."""
        deadline = time.monotonic() + timeout_s
        results = await asyncio.gather(
            *(link.client(deadline) for link in self.links), return_exceptions=True
        )
        return sum(1 for r in results if not isinstance(r, BaseException))

    def pick(self) -> KVPeer:
        return min(self.links, key=lambda link: link.in_flight_bytes)

    @property
    def transport_name(self) -> str:
        return self.links[0].transport_name

    async def drop(self) -> None:
        for link in self.links:
            await link.drop()

    def stats(self) -> list[dict[str, Any]]:
        return [link.stats() for link in self.links]


class DecoderPeer:
    """A decoder's Sidecar service (handoffs), over mutual TLS checked against ``expected`` when
    ``tls`` is set (plaintext otherwise). ``silence_floor_s``: a peer across the WAN (MD): a
    handoff ends once the peer has been silent that long (``CallSilence``); None (RLD, beside the
    sender): a handoff waits for its answer, up to its timeout (a busy RLD's event loop may pause
    for a second under load, and RLD is the only one left to decode)."""

    def __init__(
        self,
        addr: str,
        *,
        tls: TlsConfig | None,
        expected: PeerIdentity,
        silence_floor_s: float | None = None,
    ) -> None:
        self.addr = addr
        self.expected = expected
        pb2, pb2_grpc = stubs()
        self._pb2 = pb2
        self._channel = open_channel(addr, tls, expected, KEEP_CONNECTED)
        self._stub = pb2_grpc.SidecarStub(self._channel)
        self.silence = CallSilence(addr, self._ping, silence_floor_s) if silence_floor_s is not None else None

    async def connect(self, timeout_s: float) -> bool:
        """Dial now, so that the first handoff finds the connection up: dialled by the first
        handoff instead, the TLS handshake to MD crossed the WAN behind the KV already queued on
        it and failed (wan-overload, 2026-12-04: the first two P->MD requests after the warm-up of
        every run, ``peer_unreachable ... Handshake read failed``, RLD finished them). True once
        the channel is ready within ``timeout_s``; it keeps redialling a peer that is not up yet."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def handoff(self, frame: bytes, *, emit_given: bool = False, timeout_s: float) -> int:
        """The peer's level after it took ``frame``; with a silence floor, ``Unavailable``
        (``PEER_UNREACHABLE``) as soon as the peer has been silent for the bound."""
        req = self._pb2.HandoffRequest(handoff=frame, emit_given=emit_given)
        call = self._stub.Handoff(req, timeout=timeout_s)
        try:
            reply = await (self.silence.guard("handoff", call) if self.silence is not None else call)
        except grpc.aio.AioRpcError as exc:
            raise grpc_error(exc, self.addr) from None
        return int(reply.level_position)

    async def _ping(self, timeout_s: float) -> None:
        try:
            await self._stub.Ping(self._pb2.PingRequest(nonce=time.monotonic_ns()), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise grpc_error(exc, self.addr) from None

    async def close(self) -> None:
        await self._channel.close(None)


def grpc_error(exc: grpc.aio.AioRpcError, addr: str) -> PddlinkError:
    code = exc.code()
    text = f"{addr}: {code.name}: {exc.details()}"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(text)
    if code is grpc.StatusCode.UNAVAILABLE:
        return Unavailable(text, code=ErrorCode.PEER_UNREACHABLE)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return RemoteError(text, code=ErrorCode.AUTH)
    return RemoteError(text, code=ErrorCode.INTERNAL)
