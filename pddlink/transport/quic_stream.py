"""The asyncio glue of a pddlink QUIC connection: the protocol subclass and its stream lanes.

``make_protocol_class(mod)`` subclasses the chosen library's ``QuicConnectionProtocol`` (qh3 and
aioquic share that API). Every QUIC stream is a ``StreamLane``: bytes in go to a wire ``Decoder``
(or, on stream 0 before the hello, to the client-auth exchange of ``quic_auth``), decoded messages
go to the lane's ``Inbox`` (whoever owns the lane: handshake, link, or receiving session).
Sending encodes a message and queues it on the stream; the library paces it out under congestion
and flow control. Connection termination marks every lane lost, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from pddlink.errors import ErrorCode, LocalError, PddlinkError
from pddlink.transport import quic_auth
from pddlink.transport.assembler import FrameAssembler
from pddlink.transport.base import LinkStats, Message
from pddlink.transport.framing import ConnectionLost
from pddlink.transport.tcp_conn import SESSION_CAP, Greeting, Inbox
from pddlink.transport.tls import AuthError, PeerIdentity, TlsConfig, check_peer
from pddlink.wire import Handshake, Hello, HelloRefuse, encode_parts
from pddlink.wire.frame import WIRE_VERSION

log = logging.getLogger(__name__)
AUTH_REASON = "auth: "  # close reasons starting so are identity refusals


class StreamLane:
    """One QUIC stream carrying wire frames (see module docstring)."""

    def __init__(self, protocol: Any, stream_id: int) -> None:
        self.protocol = protocol
        self.stream_id = stream_id
        self.inbox = Inbox()
        self.raw: Callable[[bytes], None] | None = None  # set during client auth on stream 0
        self._frames = FrameAssembler(lambda message: self.inbox.message(self, message))  # type: ignore[arg-type]
        self._lost = False
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def lost(self) -> bool:
        return self._lost

    def feed(self, data: bytes) -> None:
        self.bytes_received += len(data)
        if self.raw is not None:
            self.raw(data)
            return
        self.frames(data)

    def frames(self, data: bytes) -> None:
        try:
            self._frames.feed(data)
        except PddlinkError as exc:
            log.warning("QUIC stream %d: %s; closing the connection", self.stream_id, exc.message)
            self.protocol.close_with(exc.message)

    def send_raw(self, data: bytes | memoryview, end_stream: bool = False) -> None:
        if self._lost or self.protocol.terminated:
            raise ConnectionLost(f"QUIC stream {self.stream_id} is closed")
        try:
            self.protocol._quic.send_stream_data(self.stream_id, data, end_stream)
        except Exception as exc:  # qh3 and aioquic raise different types for a closed connection
            self.protocol.terminate_from(exc)
            raise ConnectionLost(f"QUIC stream {self.stream_id}: {exc}") from exc
        self.bytes_sent += len(data)
        self.protocol.transmit_soon()

    def send(self, message: Message) -> int:
        head, payload = encode_parts(message)
        self.send_raw(head)
        if payload:
            self.send_raw(payload if self.protocol.takes_buffers else bytes(payload))
        return len(head) + len(payload)

    def end(self) -> None:
        if not self._lost:
            with contextlib.suppress(ConnectionLost):
                self.send_raw(b"", end_stream=True)
            self.mark_lost(None)

    def mark_lost(self, reason: str | None) -> None:
        if not self._lost:
            self._lost = True
            self.inbox.connection_lost(self, None if reason is None else ConnectionLost(reason))  # type: ignore[arg-type]

    def close(self) -> None:
        self.end()


def make_protocol_class(mod: SimpleNamespace) -> type:
    """A ``QuicConnectionProtocol`` subclass of ``mod``'s library speaking pddlink."""
    base: Any = mod.aio.QuicConnectionProtocol
    events: Any = mod.events

    class PddlinkQuicProtocol(base):  # type: ignore[misc]
        def __init__(self, *args: Any, server: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.server = server  # (listener, HandshakeConfig) on the accepting side
            self.lanes: dict[int, StreamLane] = {}
            self.control: StreamLane | None = None
            self.greeting: Greeting | None = None
            self.terminated = False
            self.takes_buffers = mod.name == "qh3"  # qh3 copies any buffer; aioquic wants bytes
            self.close_reason = ""
            self.on_new_lane: Callable[[StreamLane], None] | None = None
            self.on_terminated: Callable[[str], None] | None = None
            self._soon = False

        # -- events ------------------------------------------------------------------------
        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived):
                lane = self.lanes.get(event.stream_id) or self._new_lane(event.stream_id)
                if event.data:
                    lane.feed(event.data)
                if event.end_stream:
                    lane.mark_lost(None)
                return  # not the base class: it would wrap the stream in a StreamWriter that FINs on GC
            if isinstance(event, events.ConnectionTerminated):
                self.close_reason = event.reason_phrase or ""
                self._terminate(f"{event.reason_phrase or 'closed'} (code {event.error_code})")
            super().quic_event_received(event)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            self._terminate(f"socket closed: {exc}")

        def terminate_from(self, exc: Exception) -> None:
            self._terminate(f"library refused to send: {exc}")

        def _terminate(self, reason: str) -> None:
            if self.terminated:
                return
            self.terminated = True
            for lane in list(self.lanes.values()):
                lane.mark_lost(reason)
            if self.on_terminated is not None:
                self.on_terminated(reason)

        def _new_lane(self, stream_id: int) -> StreamLane:
            lane = self.lanes[stream_id] = StreamLane(self, stream_id)
            if self.server is not None and self.control is None:
                self.control = lane
                _ServerAuth(self, lane)
            elif self.on_new_lane is not None:
                self.on_new_lane(lane)
            return lane

        def open_lane(self) -> StreamLane:
            stream_id = self._quic.get_next_available_stream_id()
            lane = self.lanes[stream_id] = StreamLane(self, stream_id)
            return lane

        def transmit_soon(self) -> None:
            """Coalesce transmits of several sends in one loop iteration."""
            if not self._soon:
                self._soon = True
                asyncio.get_running_loop().call_soon(self._transmit_now)

        def _transmit_now(self) -> None:
            self._soon = False
            self.transmit()

        def close_with(self, reason: str) -> None:
            self._quic.close(error_code=0x1, reason_phrase=reason[:200])
            self.transmit()

        def peer_certificate_der(self) -> bytes | None:
            tls = getattr(self._quic, "tls", None) or getattr(self._quic, "_tls", None)
            cert = getattr(tls, "peer_certificate", None) or getattr(tls, "_peer_certificate", None)
            if cert is None:
                return None
            if hasattr(cert, "tbs_certificate_bytes"):  # cryptography (aioquic)
                from cryptography.hazmat.primitives.serialization import Encoding

                der: bytes = cert.public_bytes(Encoding.DER)
                return der
            raw: bytes = cert.public_bytes()  # qh3's native certificate
            return raw

        async def client_handshake(self, tls: TlsConfig, hs: Handshake) -> PeerIdentity:
            """Client: prove our identity on stream 0, then the hello; returns the server's claim."""
            try:
                return await self._client_handshake(tls, hs)
            except (ConnectionLost, TimeoutError) as exc:
                if self.close_reason.startswith(AUTH_REASON):
                    raise AuthError(f"server refused us: {self.close_reason}") from exc
                raise

        async def _client_handshake(self, tls: TlsConfig, hs: Handshake) -> PeerIdentity:
            lane = self.control = self.open_lane()
            challenge = quic_auth.PrefixReader(len(quic_auth.SERVER_CHALLENGE) + quic_auth.NONCE_BYTES)
            got: asyncio.Future[tuple[bytes, bytes]] = asyncio.get_running_loop().create_future()

            def on_raw(data: bytes) -> None:
                done = challenge.feed(data)
                if done is not None and not got.done():
                    got.set_result(done)

            lane.raw = on_raw
            lane.send_raw(quic_auth.CLIENT_OPEN)
            prefix, rest = await asyncio.wait_for(got, hs.config.timeout_s)
            if not prefix.startswith(quic_auth.SERVER_CHALLENGE):
                raise AuthError("QUIC server sent no client-auth challenge")
            nonce = prefix[len(quic_auth.SERVER_CHALLENGE) :]
            server_der = self.peer_certificate_der() or b""
            lane.raw = None
            lane.send_raw(quic_auth.make_proof(tls, nonce, server_der))
            if rest:
                lane.frames(rest)
            for message in hs.messages_to_send():
                lane.send(message)
            while not hs.done:
                hs.receive(await lane.inbox.get(hs.deadline - time.monotonic()), time.monotonic())
            if hs.error is not None:
                raise hs.error
            assert hs.peer is not None
            return PeerIdentity(hs.peer.role, hs.peer.peer_id)

        def link_stats(self, streams: int) -> LinkStats:
            sent = sum(lane.bytes_sent for lane in self.lanes.values())
            received = sum(lane.bytes_received for lane in self.lanes.values())
            core = getattr(self._quic, "_core", None)  # qh3: native counters; aioquic keeps them private
            losses = getattr(core, "loss_total", None)
            rtt = getattr(core, "smoothed_rtt", None)
            cc = "cubic" if mod.name == "aioquic" else "qh3"
            return LinkStats("quic", streams, sent, received, losses, rtt, 0, {}, cc)

    return PddlinkQuicProtocol


class _ServerAuth:
    """Accepting side of stream 0: challenge, verify the client's proof, then answer its hello."""

    def __init__(self, protocol: Any, lane: StreamLane) -> None:
        self.protocol = protocol
        self.lane = lane
        self.listener, self.config = protocol.server
        self.nonce = quic_auth.new_nonce()
        self.opening = quic_auth.PrefixReader(len(quic_auth.CLIENT_OPEN))
        self.proof: quic_auth.ProofReader | None = None
        self.greeting_task: asyncio.Future[None] | None = None
        protocol.server_auth = self  # keeps this object (and its greeting task) alive
        lane.raw = self.on_raw

    def on_raw(self, data: bytes) -> None:
        try:
            if self.proof is None:
                opened = self.opening.feed(data)
                if opened is None:
                    return
                if opened[0] != quic_auth.CLIENT_OPEN:
                    raise AuthError("client did not open the pddlink control stream")
                self.proof = quic_auth.ProofReader()
                self.lane.send_raw(quic_auth.SERVER_CHALLENGE + self.nonce)
                data = opened[1]
            done = self.proof.feed(data)
            if done is None:
                return
            cert, signature, rest = done
            server_der = self.listener.server_cert_der()
            certified = quic_auth.verify_proof(cert, signature, self.nonce, server_der, self.listener.tls)
        except PddlinkError as exc:
            log.warning("refused a QUIC client: %s", exc.message)
            self.protocol.close_with(f"{AUTH_REASON}{exc.message}")
            return
        self.lane.raw = None
        self.greeting_task = asyncio.ensure_future(self.greet(certified))
        if rest:
            self.lane.frames(rest)

    async def greet(self, certified: PeerIdentity) -> None:
        lane = self.lane
        try:
            hello = await lane.inbox.get(self.config.timeout_s)
            if not isinstance(hello, Hello):
                raise LocalError("expected Hello", code=ErrorCode.PROTOCOL)
            claimed = PeerIdentity(hello.role, hello.peer_id)
            try:
                check_peer(certified, claimed=claimed)
            except AuthError as exc:
                lane.send(HelloRefuse(ErrorCode.AUTH, exc.message[:1024], WIRE_VERSION))
                self.protocol.close_with(f"{AUTH_REASON}{exc.message}")
                return
            hs = Handshake(self.config, initiator=False, now=time.monotonic())
            hs.receive(hello, time.monotonic())
            for out in hs.messages_to_send():
                lane.send(out)
            if hs.error is not None:
                raise hs.error
            token = next(
                (c.removeprefix(SESSION_CAP) for c in hello.capabilities if c.startswith(SESSION_CAP)), ""
            )
            self.protocol.greeting = Greeting(claimed, "session", token or quic_auth.new_nonce().hex())
            self.listener.accept(self.protocol)
        except PddlinkError as exc:
            log.warning("refused a QUIC client: %s", exc.message)
            self.protocol.close_with(exc.message)
