"""QUIC links (qh3 by default, aioquic selectable): one stream per transfer, control on stream 0.

Implementation choice: ``qh3`` (Rust core, API-compatible fork) when installed, else ``aioquic``.
qh3 is the default because it moved 2-4x the bytes per CPU second of aioquic here (see
``pddlink bench link --transport quic --quic-impl aioquic|qh3``; figures in the transport report).
``PDDLINK_QUIC_IMPL`` is not read here: entry points pass ``QuicTransport.impl`` instead.

Streams: the client opens stream 0 for control (client auth, hello, then control messages) and a
fresh bidirectional stream for every transfer; the transfer's chunks flow on it and the receiver's
acks come back on it, so a transfer never waits behind another's bytes and control never waits
behind chunks. Congestion control: CUBIC on aioquic (its default is Reno); qh3's native core has its
own (not configurable from Python). Flow-control windows are ``LinkOptions.flow_control_window_bytes``
(size them at or above the bandwidth-delay product); datagrams ``LinkOptions.max_datagram_bytes``.

Lifecycle: ``connect`` -> QUIC + TLS 1.3 (server verified against the CA and expected identity) ->
client auth on stream 0 (``quic_auth``) -> hello -> transfers/messages -> ``close``. A connection
that dies fails its transfers with PEER_UNREACHABLE (QUIC itself rides out short outages).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import secrets
import socket
import ssl
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, ClassVar, cast

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from pddlink.errors import ConfigError, ErrorCode, LocalError, Unavailable
from pddlink.transfer.config import TransferManifest
from pddlink.transfer.sender import TransferSender
from pddlink.transport import quic_auth, quic_server, sockopt
from pddlink.transport.base import Buffer, Handlers, LinkOptions, LinkStats, Message, TransferResult
from pddlink.transport.quic_stream import StreamLane, make_protocol_class
from pddlink.transport.receiving import ReceivingSession
from pddlink.transport.session import PeerSession
from pddlink.transport.tcp import as_buffer, manifest_of, transfer_config
from pddlink.transport.tcp_conn import SESSION_CAP
from pddlink.transport.tls import AuthError, PeerIdentity, TlsConfig
from pddlink.transport.transfers import Lanes, SendDriver, TransferIds, await_result
from pddlink.wire import Handshake, HandshakeConfig, TransferBegin

log = logging.getLogger(__name__)
ALPN = "pddlink/1"
IMPLS = ("qh3", "aioquic")


def load_impl(name: str = "auto") -> SimpleNamespace:
    """The QUIC library's modules under one set of names."""
    for candidate in IMPLS if name == "auto" else (name,):
        try:
            mod = SimpleNamespace(
                name=candidate,
                aio=importlib.import_module(f"{candidate}.asyncio"),
                config=importlib.import_module(f"{candidate}.quic.configuration"),
                events=importlib.import_module(f"{candidate}.quic.events"),
                connection=importlib.import_module(f"{candidate}.quic.connection"),
            )
        except ImportError:
            continue
        mod.protocol = make_protocol_class(mod)
        return mod
    raise Unavailable(
        f"QUIC needs qh3 or aioquic: pip install 'pddlink[quic-native]' (qh3) or aioquic ({name})"
    )


def configuration(mod: SimpleNamespace, *, client: bool, tls: TlsConfig, options: LinkOptions) -> Any:
    config = mod.config.QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=client,
        idle_timeout=options.idle_timeout_s,
        max_data=options.flow_control_window_bytes,
        max_stream_data=options.flow_control_window_bytes,
        max_datagram_size=options.max_datagram_bytes,
    )
    if mod.name == "aioquic":
        config.congestion_control_algorithm = "cubic"
    else:
        config.verify_hostname = False  # identities are SAN URIs, checked by quic_auth
        config.probe_datagram_size = False
    # The chain and identity are verified by quic_auth right after the handshake (aioquic would
    # check a DNS name we do not put in certificates); TLS still proves the key (CertificateVerify).
    config.verify_mode = ssl.CERT_NONE
    config.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return config


class QuicLink(PeerSession):
    """The connecting side of a QUIC link."""

    transport_name = "quic"

    def __init__(self, peer: PeerIdentity, handlers: Handlers, protocol: Any, options: LinkOptions) -> None:
        super().__init__(peer, handlers)
        self.protocol = protocol
        self.options = options
        self.control: StreamLane = protocol.control
        self._senders: dict[int, tuple[SendDriver, Lanes]] = {}
        self._ids = TransferIds()
        self.transfer_router = self._route
        self._own(self.control)
        protocol.on_terminated = self._terminated

    def _own(self, lane: StreamLane) -> StreamLane:
        lane.inbox.owner = lambda _lane, message: self.on_control(message)
        while not lane.inbox.queue.empty():
            self.on_control(lane.inbox.queue.get_nowait())
        return lane

    def send_control(self, message: Message) -> None:
        self.control.send(message)

    async def send_transfer(
        self,
        begin: TransferBegin | TransferManifest,
        payload: Buffer | Sequence[Buffer],
        *,
        deadline_s: float,
    ) -> TransferResult:
        if self.closed or self.protocol.terminated:
            raise LocalError(f"QUIC link to {self.peer} is closed", code=ErrorCode.PEER_UNREACHABLE)
        data = as_buffer(payload)
        transfer_id, chunk_bytes = self._ids.assign(begin, data, self._senders)
        lanes = Lanes()
        lane = self._own(self.protocol.open_lane())
        lanes.add(lane)
        window = min(self.options.window_bytes, self.options.flow_control_window_bytes)
        config = transfer_config(
            LinkOptions(window_bytes=window, chunk_bytes=self.options.chunk_bytes), chunk_bytes
        )
        now = time.monotonic()
        sender = TransferSender(
            transfer_id, manifest_of(begin), data, config=config, deadline=now + deadline_s,
            connections=list(lanes.live), now=now,
        )  # fmt: skip
        driver = SendDriver(sender, lanes, lambda d: self._transfer_ended(d, lane))
        self._senders[transfer_id] = (driver, lanes)
        driver.start()
        return await await_result(driver, deadline_s)

    def _transfer_ended(self, driver: SendDriver, lane: StreamLane) -> None:
        self._senders.pop(driver.transfer_id, None)
        lane.end()  # FIN: the receiving side drops the stream

    def _route(self, message: Message) -> None:
        entry = self._senders.get(message.transfer_id)
        if entry is not None:
            entry[0].receive(message)

    def _terminated(self, reason: str) -> None:
        self.gave_up = True  # a QUIC connection does not come back: the owner dials a new link
        for driver, lanes in list(self._senders.values()):
            for lane_id in list(lanes.live):
                lanes.remove(lane_id)
            driver.cancel(ErrorCode.PEER_UNREACHABLE, f"QUIC connection lost: {reason}")
        self.fail_pending(LocalError(f"QUIC connection lost: {reason}", code=ErrorCode.PEER_UNREACHABLE))

    def stats(self) -> LinkStats:
        stats: LinkStats = self.protocol.link_stats(1)
        return stats

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for driver, _ in list(self._senders.values()):
            driver.cancel(ErrorCode.CANCELLED, "link closed")
        self.fail_pending(LocalError("link closed", code=ErrorCode.CANCELLED))
        await self.cancel_tasks()
        self.protocol.close()
        try:
            await asyncio.wait_for(self.protocol.wait_closed(), 2.0)
        except TimeoutError:
            log.info("QUIC close to %s not acknowledged in time", self.peer)
        self.protocol.udp_transport.close()


class QuicListener:
    """Accepts QUIC links: client auth and hello on stream 0, then one ``ReceivingSession`` each."""

    def __init__(
        self, identity: PeerIdentity, tls: TlsConfig, handlers: Handlers, options: LinkOptions
    ) -> None:
        self.identity, self.tls, self.handlers, self.options = identity, tls, handlers, options
        self.server: Any = None
        self.sessions: dict[str, ReceivingSession] = {}
        self.bound_port = 0
        self._closing: set[asyncio.Future[None]] = set()
        self._cert_der = x509.load_pem_x509_certificate(tls.cert_file.read_bytes()).public_bytes(
            serialization.Encoding.DER
        )

    def server_cert_der(self) -> bytes:
        return self._cert_der

    @property
    def port(self) -> int:
        return self.bound_port

    def links(self) -> list[ReceivingSession]:
        return [s for s in self.sessions.values() if s.connected]

    def accept(self, protocol: Any) -> None:
        """Called by the protocol once a client proved its identity and said hello."""
        greeting = protocol.greeting
        session = ReceivingSession(greeting.peer, self.handlers, self.options, "quic")
        self.sessions[greeting.token] = session
        session.attach(protocol.control, protocol.control.inbox, control=True)
        protocol.on_new_lane = lambda lane: session.attach(lane, lane.inbox, control=False)
        protocol.on_terminated = lambda reason: self._ended(greeting.token)

    def _ended(self, token: str) -> None:
        session = self.sessions.pop(token, None)
        if session is not None:
            self._closing.add(asyncio.ensure_future(session.close()))

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.close()
        if self.server is not None:
            self.server.close()


class QuicTransport:
    """Registry entry "quic". ``impl`` chooses the library ("auto": qh3, else aioquic)."""

    name: ClassVar[str] = "quic"
    impl: ClassVar[str] = "auto"

    @classmethod
    async def listen(
        cls, host: str, port: int, *, identity: PeerIdentity, tls: TlsConfig | None, handlers: Handlers,
        options: LinkOptions,
    ) -> QuicListener:  # fmt: skip
        if tls is None:
            raise ConfigError("QUIC needs TLS credentials (tls=...)")
        mod = load_impl(cls.impl)
        listener = QuicListener(identity, tls, handlers, options)
        hello = HandshakeConfig(identity.name, identity.role, timeout_s=options.connect_timeout_s)

        def create(*args: Any, **kwargs: Any) -> Any:
            return mod.protocol(*args, server=(listener, hello), **kwargs)

        config = configuration(mod, client=False, tls=tls, options=options)
        listener.server = await quic_server.serve(mod, host, port, config, create)
        # the libraries keep the bound socket private; port 0 needs it to say where we listen
        listener.bound_port = listener.server._transport.get_extra_info("sockname")[1]
        return listener

    @classmethod
    async def connect(
        cls, host: str, port: int, *, identity: PeerIdentity, tls: TlsConfig | None,
        expected_peer: PeerIdentity | None, handlers: Handlers, options: LinkOptions,
    ) -> QuicLink:  # fmt: skip
        if tls is None:
            raise ConfigError("QUIC needs TLS credentials (tls=...)")
        mod = load_impl(cls.impl)
        config = configuration(mod, client=True, tls=tls, options=options)
        protocol = await _dial(mod, host, port, config, options)
        try:
            peer = quic_auth.check_server(protocol.peer_certificate_der(), tls, expected_peer)
            token = secrets.token_hex(16)
            hello = HandshakeConfig(identity.name, identity.role, capabilities=(SESSION_CAP + token,),
                                    timeout_s=options.connect_timeout_s)  # fmt: skip
            claimed = await protocol.client_handshake(
                tls, Handshake(hello, initiator=True, now=time.monotonic())
            )
            if claimed != peer:
                raise AuthError(f"server claims {claimed} but its certificate says {peer}")
        except BaseException:
            protocol.close()
            raise
        return QuicLink(peer, handlers, protocol, options)


async def _dial(mod: SimpleNamespace, host: str, port: int, config: Any, options: LinkOptions) -> Any:
    """Open the QUIC connection on our own IPv4/IPv6 socket (the libraries' ``connect`` binds a
    dual-stack socket, which namespaces with IPv6 disabled refuse) and wait for the handshake."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sockopt.size_udp_buffers(sock)
    sock.bind(("0.0.0.0", 0) if family == socket.AF_INET else ("::", 0))
    connection = mod.connection.QuicConnection(configuration=config)

    def create() -> Any:
        return mod.protocol(connection, server=None)

    if mod.name == "qh3":
        from qh3.asyncio._transport import create_optimized_datagram_transport  # GSO/GRO where available

        transport, protocol = await create_optimized_datagram_transport(loop, create, sock=sock)
    else:
        transport, protocol = await loop.create_datagram_endpoint(create, sock=sock)
    protocol = cast(Any, protocol)
    protocol.udp_transport = transport
    protocol.connect(addr)
    try:
        await asyncio.wait_for(protocol.wait_connected(), options.connect_timeout_s)
    except (TimeoutError, ConnectionError) as exc:
        transport.close()
        unreachable = LocalError(
            f"QUIC connection to {host}:{port} failed: {exc!r}", code=ErrorCode.PEER_UNREACHABLE
        )
        raise unreachable from exc
    return protocol
