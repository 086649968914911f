"""pddlink.transfer: moving one KV transfer's bytes between two sidecars, as pure state machines.

``TransferSender`` and ``TransferReceiver`` take messages and ``now`` in and give back
``Outgoing(conn_id, message)`` to send, events, and the next timer deadline (aioquic style): no
sockets, threads or clocks here. A transport feeds them decoded ``pddlink.wire`` messages and
reports connections made and lost; see each module for its protocol and states.
"""

from pddlink.transfer.config import (
    MIB,
    TransferConfig,
    TransferManifest,
    chunk_checksum,
    transfer_digest,
)
from pddlink.transfer.events import (
    ChunkCorrupted,
    ChunkReceived,
    Outgoing,
    TransferAborted,
    TransferCompleted,
    TransferEvent,
    TransferResumed,
    TransferStarted,
)
from pddlink.transfer.receiver import ReceiverState, ReceiverStats, TransferReceiver
from pddlink.transfer.sender import SenderState, SenderStats, TransferSender

__all__ = [
    "MIB",
    "ChunkCorrupted",
    "ChunkReceived",
    "Outgoing",
    "ReceiverState",
    "ReceiverStats",
    "SenderState",
    "SenderStats",
    "TransferAborted",
    "TransferCompleted",
    "TransferConfig",
    "TransferEvent",
    "TransferManifest",
    "TransferReceiver",
    "TransferResumed",
    "TransferSender",
    "TransferStarted",
    "chunk_checksum",
    "transfer_digest",
]
