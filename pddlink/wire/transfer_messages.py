"""Messages of one KV transfer: begin, chunk, ack, resume, end, abort.

A transfer is named by ``transfer_id`` (carried in the frame header's stream id, so a transport can
route frames without decoding them) and a ``generation`` that the sender bumps on every reconnect:
anything stamped with an older generation is stale and ignored. The protocol itself (who sends what,
when) is in ``pddlink.transfer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pddlink.errors import ErrorCode, InvalidInput
from pddlink.kv.codec import CodecId
from pddlink.wire.fields import (
    U128,
    BlockHashList,
    EnumOf,
    ListOf,
    Payload,
    Str,
    StructOf,
    UVarint,
    WireStruct,
)
from pddlink.wire.frame import MessageType, WireMessage, register
from pddlink.wire.messages import CODE, MAX_BLOCK_HASHES, REASON, REQUEST_ID, U32, U64

MAX_CHUNKS = 2**32 - 1
MAX_ACK_RANGE = 65_536  # indices listed in one ack/resume
GENERATION = U32
CHUNK_INDEX = U32
INDEX_LIST = ListOf(CHUNK_INDEX, MAX_ACK_RANGE)


@dataclass(frozen=True, slots=True)
class KVLayoutSpec(WireStruct):
    """The KV layout as it travels (same fields as ``pddlink.kv.layout.KVLayout``; build one with
    ``KVLayoutSpec(**layout.to_dict())``). Two sides exchange KV only when these are equal."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    WIRE_FIELDS = (
        ("model_id", Str(256)),
        ("num_layers", U32),
        ("num_kv_heads", U32),
        ("head_dim", U32),
        ("dtype", Str(32)),
        ("block_size", U32),
    )

    def _check_invariants(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise InvalidInput(f"KVLayoutSpec.{name} must be positive")


@register
@dataclass(frozen=True, slots=True)
class TransferBegin(WireMessage):
    """Opens a transfer (generation 0) or asks to resume it (a higher generation).

    ``block_hashes`` name the blocks carried, starting at block ``first_block`` of the request;
    ``num_tokens`` counts the real tokens (the last block may be partial). ``deadline_ms`` is the time
    left when sent: the receiver sets its own deadline from its own clock (no clock sync needed).
    ``codec`` is how the payload encodes the KV (``pddlink.kv.payload``): ``total_bytes`` counts the
    encoded bytes; an id this build does not know is refused when the message is decoded.
    """

    WIRE_TYPE: ClassVar[MessageType] = MessageType.TRANSFER_BEGIN
    STREAM_FIELD: ClassVar[str | None] = "transfer_id"
    transfer_id: int
    generation: int
    request_id: str
    layout: KVLayoutSpec
    first_block: int
    num_tokens: int
    block_hashes: tuple[int, ...]
    codec: CodecId
    total_bytes: int
    chunk_bytes: int
    deadline_ms: int
    WIRE_FIELDS = (
        ("transfer_id", U64),
        ("generation", GENERATION),
        ("request_id", REQUEST_ID),
        ("layout", StructOf(KVLayoutSpec)),
        ("first_block", U32),
        ("num_tokens", U32),
        ("block_hashes", BlockHashList(MAX_BLOCK_HASHES)),
        ("codec", EnumOf(CodecId)),
        ("total_bytes", UVarint(48)),
        ("chunk_bytes", U32),
        ("deadline_ms", U32),
    )

    def _check_invariants(self) -> None:
        if self.chunk_bytes <= 0:
            raise InvalidInput("TransferBegin.chunk_bytes must be positive")
        if self.num_chunks > MAX_CHUNKS:
            raise InvalidInput(f"TransferBegin needs {self.num_chunks} chunks, limit {MAX_CHUNKS}")

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)


@register
@dataclass(frozen=True, slots=True)
class Chunk(WireMessage):
    """Bytes ``[offset, offset + len(payload))`` of the transfer; ``checksum`` is xxh3-64 of the payload.
    The payload is the frame payload: encoded and decoded without copying."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.CHUNK
    STREAM_FIELD: ClassVar[str | None] = "transfer_id"
    PAYLOAD_FIELD: ClassVar[str | None] = "payload"
    transfer_id: int
    generation: int
    index: int
    offset: int
    checksum: int
    payload: bytes | memoryview
    WIRE_FIELDS = (
        ("transfer_id", U64),
        ("generation", GENERATION),
        ("index", CHUNK_INDEX),
        ("offset", UVarint(48)),
        ("checksum", U64),
        ("payload", Payload()),
    )


@register
@dataclass(frozen=True, slots=True)
class Ack(WireMessage):
    """Receiver -> sender: every chunk below ``next_index`` is held and verified (cumulative);
    ``received`` lists held chunks above it; ``resend`` asks again for chunks that arrived corrupt."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.ACK
    STREAM_FIELD: ClassVar[str | None] = "transfer_id"
    transfer_id: int
    generation: int
    next_index: int
    received: tuple[int, ...] = ()
    resend: tuple[int, ...] = ()
    WIRE_FIELDS = (
        ("transfer_id", U64),
        ("generation", GENERATION),
        ("next_index", CHUNK_INDEX),
        ("received", INDEX_LIST),
        ("resend", INDEX_LIST),
    )

    def _check_invariants(self) -> None:
        if any(i < self.next_index for i in self.received):
            raise InvalidInput("Ack.received lists a chunk below next_index")


@register
@dataclass(frozen=True, slots=True)
class Resume(WireMessage):
    """Receiver -> sender, answering a ``TransferBegin`` of a new generation: what it already holds."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.RESUME
    STREAM_FIELD: ClassVar[str | None] = "transfer_id"
    transfer_id: int
    generation: int
    next_index: int
    received: tuple[int, ...] = ()
    WIRE_FIELDS = (
        ("transfer_id", U64),
        ("generation", GENERATION),
        ("next_index", CHUNK_INDEX),
        ("received", INDEX_LIST),
    )

    def _check_invariants(self) -> None:
        if any(i < self.next_index for i in self.received):
            raise InvalidInput("Resume.received lists a chunk below next_index")


@register
@dataclass(frozen=True, slots=True)
class TransferEnd(WireMessage):
    """Sender -> receiver after the last chunk is sent; receiver -> sender once every chunk is held and
    the digest (xxh3-128 over the chunk checksums in index order) matches: the transfer is done."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.TRANSFER_END
    STREAM_FIELD: ClassVar[str | None] = "transfer_id"
    transfer_id: int
    generation: int
    num_chunks: int
    digest: int
    WIRE_FIELDS = (
        ("transfer_id", U64),
        ("generation", GENERATION),
        ("num_chunks", CHUNK_INDEX),
        ("digest", U128()),
    )


@register
@dataclass(frozen=True, slots=True)
class Abort(WireMessage):
    """Either side: the transfer is over, unfinished, for ``code``/``reason``."""

    WIRE_TYPE: ClassVar[MessageType] = MessageType.ABORT
    STREAM_FIELD: ClassVar[str | None] = "transfer_id"
    transfer_id: int
    generation: int
    code: ErrorCode
    reason: str
    WIRE_FIELDS = (
        ("transfer_id", U64),
        ("generation", GENERATION),
        ("code", CODE),
        ("reason", REASON),
    )
