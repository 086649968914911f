"""What the transfer state machines hand back: messages to send (with their connection) and events.

A transport sends every ``Outgoing`` on its ``conn_id`` (encoded with ``pddlink.wire.encode_parts``),
and the sidecar reacts to events. Both are plain frozen values.
"""

from __future__ import annotations

from dataclasses import dataclass

from pddlink.errors import ErrorCode
from pddlink.wire.frame import WireMessage
from pddlink.wire.transfer_messages import TransferBegin


@dataclass(frozen=True, slots=True)
class Outgoing:
    conn_id: int
    message: WireMessage


@dataclass(frozen=True, slots=True)
class TransferStarted:
    """Receiver: the transfer's ``TransferBegin`` arrived (generation 0 or first seen)."""

    transfer_id: int
    begin: TransferBegin


@dataclass(frozen=True, slots=True)
class ChunkReceived:
    """Receiver: a verified chunk; ``payload`` is the decoded frame's buffer (no copy)."""

    transfer_id: int
    index: int
    offset: int
    payload: memoryview


@dataclass(frozen=True, slots=True)
class ChunkCorrupted:
    """Receiver: a chunk failed its checksum and was asked for again (``attempt`` counts failures)."""

    transfer_id: int
    index: int
    attempt: int


@dataclass(frozen=True, slots=True)
class TransferResumed:
    """Sender: the receiver answered a reconnect; ``chunks_to_send`` still need sending."""

    transfer_id: int
    generation: int
    next_index: int
    chunks_to_send: int


@dataclass(frozen=True, slots=True)
class TransferCompleted:
    transfer_id: int
    total_bytes: int
    digest: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class TransferAborted:
    """Either side: the transfer ended unfinished. ``remote`` is True when the peer sent the abort."""

    transfer_id: int
    code: ErrorCode
    reason: str
    remote: bool


TransferEvent = (
    TransferStarted | ChunkReceived | ChunkCorrupted | TransferResumed | TransferCompleted | TransferAborted
)
