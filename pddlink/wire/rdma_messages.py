"""RDMA fast-path messages: queue-pair set-up and slot credits, carried on a link's TCP control link.

Who sends what is ``pddlink.wire.rdma_setup`` (the set-up state machine) and
``pddlink.transport.rdma_lanes`` (credits). A side puts ``RDMA_CAPABILITY`` in its Hello when it
speaks these messages, whether or not it has a device (a side without one answers ``RdmaDecline``
with its reason, so the peer can log why). They are only ever sent on a connection whose handshake
agreed on ``rdma/1``: a peer that does not advertise it never sees them (it would refuse the
unknown type) and simply gets TCP.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

from pddlink.errors import ErrorCode
from pddlink.wire.fields import EnumOf, FixedBytes, ListOf, StructOf, UVarint, WireStruct
from pddlink.wire.frame import MessageType, WireMessage, register
from pddlink.wire.messages import CODE, REASON, U32, U64

RDMA_CAPABILITY = "rdma/1"
MAX_SLOTS = 4096


class ChannelRole(IntEnum):
    SENDER = 1
    RECEIVER = 2


class PathMtu(IntEnum):
    """libibverbs ``IBV_MTU_*`` values."""

    MTU_256 = 1
    MTU_512 = 2
    MTU_1024 = 3
    MTU_2048 = 4
    MTU_4096 = 5


@dataclass(frozen=True, slots=True)
class RdmaEndpoint(WireStruct):
    """What one side tells the other to connect a reliable-connected queue pair.

    ``gid`` is the 16-byte GID (RoCE routes on it; on InfiniBand ``lid`` routes). ``rkey``/``addr``
    and ``slots`` x ``slot_bytes`` describe the receiver's landing region; a sender leaves them 0.
    Whether an endpoint suits this side (roles, region size) is the set-up machine's check, not the
    codec's: any value that fits its field decodes."""

    role: ChannelRole
    qp_num: int
    psn: int
    lid: int
    port_num: int
    path_mtu: PathMtu
    gid: bytes
    rkey: int = 0
    addr: int = 0
    slots: int = 0
    slot_bytes: int = 0
    WIRE_FIELDS = (
        ("role", EnumOf(ChannelRole)),
        ("qp_num", UVarint(24)),
        ("psn", UVarint(24)),
        ("lid", UVarint(16)),
        ("port_num", UVarint(8)),
        ("path_mtu", EnumOf(PathMtu)),
        ("gid", FixedBytes(16)),
        ("rkey", U32),
        ("addr", U64),
        ("slots", UVarint(16)),
        ("slot_bytes", U32),
    )

    @property
    def length(self) -> int:
        """Bytes of the landing region (0 on a sender)."""
        return self.slots * self.slot_bytes

    @property
    def gid_text(self) -> str:
        """The GID as libibverbs prints it (eight groups of four hex digits)."""
        h = self.gid.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))


@register
@dataclass(frozen=True, slots=True)
class RdmaSetup(WireMessage):
    """This side's queue-pair endpoint: the receiver sends it first, the sender answers with its own."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.RDMA_SETUP
    endpoint: RdmaEndpoint
    WIRE_FIELDS = (("endpoint", StructOf(RdmaEndpoint)),)


@register
@dataclass(frozen=True, slots=True)
class RdmaReady(WireMessage):
    """Receiver -> sender: its queue pair is connected; chunks may now be written."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.RDMA_READY
    WIRE_FIELDS = ()


@register
@dataclass(frozen=True, slots=True)
class RdmaDecline(WireMessage):
    """Either side, at any time: no (more) RDMA on this link, for ``code``/``reason``; chunks use TCP."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.RDMA_DECLINE
    code: ErrorCode
    reason: str
    WIRE_FIELDS = (("code", CODE), ("reason", REASON))


@register
@dataclass(frozen=True, slots=True)
class RdmaCredit(WireMessage):
    """Receiver -> sender: these landing slots were read and may be written again."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.RDMA_CREDIT
    slots: tuple[int, ...]
    WIRE_FIELDS = (("slots", ListOf(UVarint(16), MAX_SLOTS)),)
