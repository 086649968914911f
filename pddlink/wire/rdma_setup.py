"""RDMA fast-path set-up over a link's control connection, as a sans-I/O state machine.

Theory of operation. After the hello each side knows whether the handshake agreed on ``rdma/1``
(``peer_offers``) and whether it can do RDMA itself (``LocalRdma``: the endpoint of a queue pair it
created, or the reason it cannot: no device, no pyverbs, a verbs call failed). Then::

    receiver (RelayDecode side, listens)          sender (P side, connects)
    RdmaSetup(receiver endpoint)   ----------------->
                                                  ConnectQueuePair -> adapter: INIT -> RTR -> RTS
                                   <----------------- RdmaSetup(sender endpoint)
    ConnectQueuePair -> adapter connects
    RdmaReady                      ----------------->
    path: RDMA (polls its landing slots)          path: RDMA (chunks by RDMA write)

Acks, transfer begin/end and slot credits stay on the TCP control connection either way. A side
that cannot go on (no local RDMA, bad peer endpoint, a failed connect) sends ``RdmaDecline`` with
its reason and settles on TCP; a side that receives ``RdmaDecline`` settles on TCP, at any time,
even after RDMA was selected (a receiver accepts chunks from both paths, so that is always safe).
A peer that did not offer ``rdma/1`` is sent nothing: it would not understand the messages.
Once on TCP, late set-up messages are ignored (the peer gets, or already got, our decline).

Deadline (decided): set-up not complete by ``now + timeout_s`` falls back to TCP with reason
``SETUP_TIMEOUT`` and tells the peer ``RdmaDecline(DEADLINE_EXCEEDED)``. It does not fail the link:
TCP works, RDMA only makes it faster, and failing would turn a slow NIC into an outage. States::

    receiver: AWAIT_ENDPOINT --setup--> CONNECTING --connected--> RDMA
    sender:   AWAIT_ENDPOINT --setup--> CONNECTING --connected--> AWAIT_READY --ready--> RDMA
    any state but TCP --decline | local failure | bad endpoint | wrong message | deadline--> TCP

Drive it like the hello handshake: ``receive(msg, now)``; after a ``ConnectQueuePair`` event,
``endpoint_connected(now)`` or ``local_failed(reason, now)``; ``handle_timer(now)`` at
``get_timer()``; send ``messages_to_send()`` on the control connection; drain ``next_event()``
(``FastPathSelected`` each time the path is decided or changes). ``error`` is the typed reason of a
fallback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from pddlink.errors import (
    ConfigError,
    DeadlineExceeded,
    ErrorCode,
    InvalidInput,
    PddlinkError,
    RemoteError,
    Unavailable,
)
from pddlink.wire.errors import WireError
from pddlink.wire.frame import WireMessage
from pddlink.wire.rdma_messages import ChannelRole, RdmaDecline, RdmaEndpoint, RdmaReady, RdmaSetup


class SetupState(Enum):
    AWAIT_ENDPOINT = "await_endpoint"
    CONNECTING = "connecting"
    AWAIT_READY = "await_ready"
    RDMA = "rdma"
    TCP = "tcp"


class Fallback(Enum):
    """Why a link's chunks use TCP. A closed set: the values are metric labels."""

    PEER_NOT_OFFERED = "peer_not_offered"
    LOCAL_UNAVAILABLE = "local_unavailable"
    PEER_DECLINED = "peer_declined"
    BAD_PEER_ENDPOINT = "bad_peer_endpoint"
    LOCAL_FAILED = "local_failed"
    PROTOCOL = "protocol"
    SETUP_TIMEOUT = "setup_timeout"


class BadRdmaEndpoint(InvalidInput):
    """The peer's endpoint decoded but cannot be connected to (wrong role, no or too small slots)."""


class RdmaSetupOutOfOrder(WireError):
    """A set-up message arrived in a state that does not expect it."""


@dataclass(frozen=True, slots=True)
class LocalRdma:
    """This side's RDMA: the endpoint of its queue pair, or why it has none."""

    endpoint: RdmaEndpoint | None
    reason: str = ""

    def __post_init__(self) -> None:
        if (self.endpoint is None) == (not self.reason):
            raise InvalidInput("LocalRdma is an endpoint or a reason, exactly one of them")

    @classmethod
    def unavailable(cls, reason: str) -> LocalRdma:
        return cls(None, reason)


@dataclass(frozen=True, slots=True)
class SetupConfig:
    """``timeout_s``: time from the hello to RDMA ready; ``min_slot_bytes``: the sender's largest
    frame (a chunk with its header), which every landing slot must hold."""

    timeout_s: float = 5.0
    min_slot_bytes: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"SetupConfig.timeout_s must be positive, got {self.timeout_s}")
        if self.min_slot_bytes < 1:
            raise ConfigError("SetupConfig.min_slot_bytes must be positive")


@dataclass(frozen=True, slots=True)
class ConnectQueuePair:
    """Adapter: connect the local queue pair to ``peer``, then call ``endpoint_connected`` (or
    ``local_failed``)."""

    peer: RdmaEndpoint


@dataclass(frozen=True, slots=True)
class FastPathSelected:
    """The link's chunks go by ``path`` ("rdma" or "tcp"); ``fallback`` and ``reason`` say why TCP."""

    path: str
    fallback: Fallback | None
    reason: str


SetupEvent = ConnectQueuePair | FastPathSelected
MAX_REASON_BYTES = 1024  # the wire's REASON field: UTF-8 bytes, not characters


def clip_utf8(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, never inside a character."""
    return text.encode("utf-8", "replace")[:max_bytes].decode("utf-8", "ignore")


_OFFER_NOTE = "(it has no rdma/1 in its hello: an older build or transport 'tcp')"


class RdmaNegotiation:
    """One side of the RDMA set-up of one link (see the module docstring)."""

    def __init__(
        self,
        role: ChannelRole,
        *,
        peer_offers: bool,
        local: LocalRdma,
        now: float,
        config: SetupConfig | None = None,
    ) -> None:
        if local.endpoint is not None and local.endpoint.role is not role:
            raise InvalidInput(f"local endpoint is a {local.endpoint.role.name}, this side a {role.name}")
        self.role = role
        self.config = cfg = config or SetupConfig()
        self.local = local
        self.deadline = now + cfg.timeout_s
        self.state = SetupState.AWAIT_ENDPOINT
        self.peer_endpoint: RdmaEndpoint | None = None
        self.error: PddlinkError | None = None
        self.outcome: FastPathSelected | None = None
        self._out: list[WireMessage] = []
        self._events: list[SetupEvent] = []
        if not peer_offers:
            self._to_tcp(Fallback.PEER_NOT_OFFERED, Unavailable(f"peer does not offer RDMA {_OFFER_NOTE}"))
        elif local.endpoint is None:
            self._decline(Fallback.LOCAL_UNAVAILABLE, Unavailable(local.reason), ErrorCode.UNAVAILABLE)
        elif role is ChannelRole.RECEIVER:
            self._out.append(RdmaSetup(local.endpoint))

    # --- inputs -------------------------------------------------------------------------------

    def receive(self, msg: WireMessage, now: float) -> None:
        """Feed a set-up message from the control connection (other types: ``InvalidInput``)."""
        if not isinstance(msg, RdmaSetup | RdmaReady | RdmaDecline):
            raise InvalidInput(f"{type(msg).__name__} is not an RDMA set-up message")
        if self.state is SetupState.TCP:
            return  # late: the peer has (or will get) our decline
        if isinstance(msg, RdmaDecline):
            self._to_tcp(
                Fallback.PEER_DECLINED, RemoteError(f"peer declined RDMA: {msg.reason}", code=msg.code)
            )
        elif isinstance(msg, RdmaSetup) and self.state is SetupState.AWAIT_ENDPOINT:
            self._on_peer_endpoint(msg.endpoint)
        elif isinstance(msg, RdmaReady) and self.state is SetupState.AWAIT_READY:
            self._select_rdma()
        else:
            problem = f"{type(msg).__name__} in state {self.state.value} ({self.role.name.lower()})"
            self._decline(Fallback.PROTOCOL, RdmaSetupOutOfOrder(problem), ErrorCode.PROTOCOL)

    def endpoint_connected(self, now: float) -> None:
        """The adapter connected the local queue pair as a ``ConnectQueuePair`` event asked."""
        if self.state is not SetupState.CONNECTING:
            if self.state is SetupState.TCP:
                return  # fell back (deadline, decline) while the adapter was connecting
            raise InvalidInput(f"endpoint_connected in state {self.state.value}")
        if self.role is ChannelRole.RECEIVER:
            self._out.append(RdmaReady())
            self._select_rdma()
        else:
            assert self.local.endpoint is not None
            self._out.append(RdmaSetup(self.local.endpoint))
            self.state = SetupState.AWAIT_READY

    def local_failed(self, reason: str, now: float) -> None:
        """This side cannot (or can no longer) use RDMA: a verbs call or a completion failed."""
        if self.state is not SetupState.TCP:
            self._decline(Fallback.LOCAL_FAILED, Unavailable(reason), ErrorCode.UNAVAILABLE)

    def get_timer(self) -> float | None:
        return None if self.state in (SetupState.RDMA, SetupState.TCP) else self.deadline

    def handle_timer(self, now: float) -> None:
        if self.get_timer() is not None and now >= self.deadline:
            error = DeadlineExceeded(
                f"RDMA set-up not complete within {self.config.timeout_s} s (state {self.state.value})"
            )
            self._decline(Fallback.SETUP_TIMEOUT, error, ErrorCode.DEADLINE_EXCEEDED)

    # --- outputs ------------------------------------------------------------------------------

    def messages_to_send(self) -> list[WireMessage]:
        out, self._out = self._out, []
        return out

    def next_event(self) -> SetupEvent | None:
        return self._events.pop(0) if self._events else None

    @property
    def path(self) -> str | None:
        """ "rdma" or "tcp" once decided, else None."""
        return self.outcome.path if self.outcome is not None else None

    # --- internals ----------------------------------------------------------------------------

    def _on_peer_endpoint(self, peer: RdmaEndpoint) -> None:
        problem = self._unusable(peer)
        if problem is not None:
            self._decline(Fallback.BAD_PEER_ENDPOINT, BadRdmaEndpoint(problem), ErrorCode.BAD_REQUEST)
            return
        self.peer_endpoint = peer
        self.state = SetupState.CONNECTING
        self._events.append(ConnectQueuePair(peer))

    def _unusable(self, peer: RdmaEndpoint) -> str | None:
        if peer.role is self.role:
            return f"both ends claim the {self.role.name} role"
        if peer.role is ChannelRole.RECEIVER:
            if peer.slots == 0 or peer.slot_bytes == 0:
                return "the receiver endpoint describes no landing slots"
            if peer.slot_bytes < self.config.min_slot_bytes:
                need = self.config.min_slot_bytes
                return f"landing slots of {peer.slot_bytes} bytes cannot hold a {need}-byte frame"
        return None

    def _select_rdma(self) -> None:
        self.state = SetupState.RDMA
        self.outcome = FastPathSelected("rdma", None, "RDMA queue pair connected")
        self._events.append(self.outcome)

    def _decline(self, why: Fallback, error: PddlinkError, code: ErrorCode) -> None:
        self._out.append(RdmaDecline(code, clip_utf8(error.message, MAX_REASON_BYTES)))
        self._to_tcp(why, error)

    def _to_tcp(self, why: Fallback, error: PddlinkError) -> None:
        self.state = SetupState.TCP
        self.error = error
        self.outcome = FastPathSelected("tcp", why, error.message)
        self._events.append(self.outcome)
