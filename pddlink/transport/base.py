"""The contract every transport adapter meets (tcp, quic, rdma), and the data it hands back.

A transport is a class registered by name in ``registry.py`` with two class methods:
``listen(...) -> Listener`` and ``connect(...) -> Link``. Both ends of a link are symmetric for
control messages (either side may send; the other side's ``Handlers.on_message`` sees them); KV
transfers go from the connecting side (``Link.send_transfer``) to the listening side
(``Handlers.on_transfer``). The transport does only I/O: framing is ``pddlink.wire``; windows,
acks, resume, integrity and deadlines are ``pddlink.transfer``.

Lifecycle of a link: connect (TCP + TLS handshake, hello exchange with peer identity checked
against the certificate, data connections joined to the session) -> any number of transfers and
control messages -> ``close()``. A transfer ends in a ``TransferResult`` or raises a
``PddlinkError`` whose ``code`` is the reason (DEADLINE_EXCEEDED, PEER_UNREACHABLE, AUTH, ...);
the receiver sees the same abort reason through ``Handlers.on_transfer_failed``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pddlink.errors import ConfigError, PddlinkError
from pddlink.kv.codec import CodecId

if TYPE_CHECKING:
    from pddlink.transport.tls import PeerIdentity, TlsConfig

Buffer = bytes | bytearray | memoryview
# A control message of pddlink.wire (Handoff, Ping, PrefixReserve, ...). Typed loosely here so the
# contract does not change when the wire module adds message types.
Message = Any
CONGESTION_CONTROLS = ("bbr", "cubic", "reno")
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class LinkOptions:
    """Tuning of one link. Defaults suit a WAN of tens of ms RTT and a few Gbit/s."""

    streams: int = 4  # striped data connections (TCP); QUIC uses one stream per transfer
    congestion_control: str = "bbr"  # falls back to the kernel default when unavailable
    chunk_bytes: int = 4 * MiB
    # Unacked bytes per transfer. Chunks are bound to a stripe when sent, so a window much larger
    # than the path needs parks chunks behind a stripe that stalls; 32 MiB is 8 BDPs at 1 Gbit/s x
    # 30 ms and keeps loopback at full speed.
    window_bytes: int = 32 * MiB
    write_high_water_bytes: int = 16 * MiB  # per connection, before the writer waits for drain
    connect_timeout_s: float = 10.0
    reconnect_attempts: int = 3  # per lost data connection, while a deadline leaves time
    reconnect_backoff_s: float = 0.2
    idle_timeout_s: float = 60.0  # a peer silent this long is gone (TCP keepalive/user timeout, QUIC idle)
    max_datagram_bytes: int = 1452  # QUIC: 8952 fits loopback's MTU; pick the path's on a WAN
    flow_control_window_bytes: int = 64 * MiB  # QUIC stream and connection windows (>= BDP)
    # The line's rate in bit/s when it is known (a leased WAN line; 0: unknown). TCP stripes then
    # pace at line_rate / streams each (SO_MAX_PACING_RATE) instead of each probing for the whole
    # line: N BBR flows keep about one BDP queued at the bottleneck between them, which overflows a
    # buffer shallower than that (measured across netlab, 1 Gbit/s x 30 ms with a 24 ms queue: 5-8%
    # of packets dropped by the queue with 4 stripes, none paced). For links whose stripes all carry
    # one bulk transfer; a pool of links that each carry a single transfer leaves it at 0.
    line_rate_bps: float = 0.0

    @property
    def stripe_pacing_bytes_per_s(self) -> float:
        """Each TCP stripe's pacing rate in bytes/s (0: unpaced)."""
        return self.line_rate_bps / 8 / self.streams

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= 64:
            raise ConfigError(f"LinkOptions.streams={self.streams}: must be 1-64")
        if self.congestion_control not in CONGESTION_CONTROLS:
            raise ConfigError(f"LinkOptions.congestion_control must be one of {CONGESTION_CONTROLS}")
        if not 4096 <= self.chunk_bytes <= 256 * MiB:
            raise ConfigError("LinkOptions.chunk_bytes must be 4 KiB - 256 MiB")
        if self.window_bytes < self.chunk_bytes:
            raise ConfigError("LinkOptions.window_bytes must hold at least one chunk")
        if self.connect_timeout_s <= 0 or self.idle_timeout_s <= 0 or self.reconnect_backoff_s < 0:
            raise ConfigError("LinkOptions timeouts must be positive")
        if not 1200 <= self.max_datagram_bytes <= 65527:
            raise ConfigError("LinkOptions.max_datagram_bytes must be 1200-65527")
        if not 0 <= self.line_rate_bps <= 1e13:
            raise ConfigError(f"LinkOptions.line_rate_bps={self.line_rate_bps}: must be 0-1e13 (0: unknown)")


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What the sender learns when the receiver has confirmed a transfer whole."""

    transfer_id: int
    bytes: int
    chunks: int
    seconds: float
    resent_chunks: int = 0  # chunks sent again after a lost connection (never acked ones)
    reconnects: int = 0
    codec: CodecId = CodecId.RAW  # how the payload travelled (``KVClient`` fills the next two)
    raw_bytes: int | None = None  # the KV bytes before the codec (None: ``bytes``, no codec ran)
    codec_seconds: float = 0.0  # spent encoding before the first byte left

    @property
    def kv_bytes(self) -> int:
        """KV bytes delivered, before compression."""
        return self.bytes if self.raw_bytes is None else self.raw_bytes


@dataclass(frozen=True, slots=True)
class ReceivedTransfer:
    """A completed, verified transfer as the receiver's handler gets it."""

    peer: PeerIdentity
    begin: Message  # the wire TransferBegin: request id, block hashes, layout, codec, ...
    chunks: Sequence[memoryview]  # payload chunks in order; join or import them in place
    seconds: float
    duplicate_chunks: int = 0  # chunks that arrived again although held (0 after a clean resume)
    stale_chunks: int = 0  # chunks of an older generation, ignored (in flight when a lane was lost)
    wire_bytes: int | None = None  # bytes that crossed when ``KVServer`` decoded a codec (else None)

    @property
    def bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def codec(self) -> CodecId:
        """The codec the payload travelled in (the chunks here are already decoded by ``KVServer``)."""
        return CodecId(getattr(self.begin, "codec", CodecId.RAW))

    def release(self) -> None:
        """Give the chunk buffers back for reuse. Call it only when no view of them is kept."""
        from pddlink.transport.buffers import RECEIVE_POOL

        for chunk in self.chunks:
            if isinstance(chunk.obj, bytearray):
                RECEIVE_POOL.release(chunk.obj)


@dataclass(frozen=True, slots=True)
class LinkStats:
    """Counters a sidecar exports as metrics."""

    transport: str
    streams: int
    bytes_sent: int = 0
    bytes_received: int = 0
    retransmits: int | None = None  # TCP_INFO total_retrans summed over connections, where known
    rtt_s: float | None = None
    reconnects: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    congestion_control: str | None = None  # what actually runs (bbr, cubic, "qh3" for qh3's own)


OnTransfer = Callable[[ReceivedTransfer], Awaitable[None] | None]
OnMessage = Callable[["PeerIdentity", Message], Awaitable[Message | None] | Message | None]
OnTransferFailed = Callable[["PeerIdentity", Message | None, PddlinkError], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class Handlers:
    """Callbacks of one endpoint. A reply returned by ``on_message`` goes back on the control
    channel, correlated with the request (see ``Link.request``)."""

    on_transfer: OnTransfer | None = None
    on_message: OnMessage | None = None
    on_transfer_failed: OnTransferFailed | None = None


class Link(Protocol):
    """The connecting side of a link to one peer."""

    @property
    def peer(self) -> PeerIdentity: ...

    async def send_transfer(
        self, begin: Message, payload: Buffer | Sequence[Buffer], *, deadline_s: float
    ) -> TransferResult: ...

    async def send_message(self, message: Message) -> None: ...

    async def request(self, message: Message, *, timeout_s: float) -> Message: ...

    def stats(self) -> LinkStats: ...

    @property
    def usable(self) -> bool: ...

    async def close(self) -> None: ...


class Listener(Protocol):
    """The listening side: accepts links, runs handlers."""

    @property
    def port(self) -> int: ...

    def links(self) -> Sequence[Link]: ...

    async def close(self) -> None: ...


class Transport(Protocol):
    """A registered transport class."""

    name: ClassVar[str]

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
    ) -> Listener: ...

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
    ) -> Link: ...
