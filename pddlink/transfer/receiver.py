"""The receiving side of one KV transfer, as a sans-I/O state machine.

Theory of operation. A receiver is created for the first message of an unknown transfer id. Chunks
may come before their ``TransferBegin`` (striped connections race): they are held, up to
``max_early_bytes`` and ``begin_timeout_s``. Once begun, chunks are accepted in any order and on any
connection; each is checked against its xxh3-64 checksum: a good one is stored and acknowledged (on
the connection it came on: cumulative ``next_index`` plus a selective list), a corrupt one is asked
for again (``Ack.resend``), at most ``max_chunk_retries`` times. Chunks of an older generation are
stale (sent before a reconnect) and ignored, as are duplicates. When every chunk is held and the
sender's ``TransferEnd`` arrived, the digest is checked and echoed back: the transfer is complete.

Resume: a ``TransferBegin`` of a newer (or the same, repeated) generation is answered with
``Resume`` listing what is held
(also after completion, followed by the ``TransferEnd`` echo, in case the first echo was lost).
Deadline: ``TransferBegin.deadline_ms`` from arrival, by this side's clock; past it the receiver
aborts (event + ``Abort``), whether or not the sender is still there.

States: AWAIT_BEGIN -> RECEIVING -> COMPLETED | ABORTED (ABORTED reachable from any state).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

from pddlink.errors import ErrorCode, InvalidInput
from pddlink.transfer.config import TransferConfig, chunk_checksum, transfer_digest
from pddlink.transfer.events import (
    ChunkCorrupted,
    ChunkReceived,
    Outgoing,
    TransferAborted,
    TransferCompleted,
    TransferEvent,
    TransferStarted,
)
from pddlink.wire.frame import WireMessage
from pddlink.wire.transfer_messages import (
    MAX_ACK_RANGE,
    Abort,
    Ack,
    Chunk,
    Resume,
    TransferBegin,
    TransferEnd,
)


class ReceiverState(Enum):
    AWAIT_BEGIN = "await_begin"
    RECEIVING = "receiving"
    COMPLETED = "completed"
    ABORTED = "aborted"


@dataclass(slots=True)
class ReceiverStats:
    chunks_received: int = 0
    bytes_received: int = 0
    duplicate_chunks: int = 0
    stale_chunks: int = 0
    corrupt_chunks: int = 0


class TransferReceiver:
    """Receives transfer ``transfer_id``; see the module docstring."""

    def __init__(self, transfer_id: int, *, config: TransferConfig, now: float) -> None:
        self.transfer_id = transfer_id
        self.config = config
        self.state = ReceiverState.AWAIT_BEGIN
        self.deadline = now + config.begin_timeout_s
        self.begin: TransferBegin | None = None
        self.generation = -1
        self.stats = ReceiverStats()
        self._started = now
        self._early: list[tuple[Chunk, int]] = []
        self._early_bytes = 0
        self._early_dropped: set[int] = set()
        self._data = bytearray()
        self._held = bytearray()
        self._checksums: list[int] = []
        self._next_index = 0
        self._above: set[int] = set()  # held chunks above next_index
        self._failures: dict[int, int] = {}
        self._end: TransferEnd | None = None
        self._last_conn: int | None = None
        self._out: list[Outgoing] = []
        self._events: deque[TransferEvent] = deque()

    # --- inputs -------------------------------------------------------------------------------

    def receive(self, msg: WireMessage, conn_id: int, now: float) -> None:
        """A message of this transfer arrived on connection ``conn_id``."""
        if getattr(msg, "transfer_id", None) != self.transfer_id:
            raise InvalidInput(f"{type(msg).__name__} is not for transfer {self.transfer_id}")
        self._last_conn = conn_id
        if isinstance(msg, Chunk):
            self._on_chunk(msg, conn_id, now)
        elif isinstance(msg, TransferBegin):
            self._on_begin(msg, conn_id, now)
        elif isinstance(msg, TransferEnd):
            self._on_end(msg, conn_id, now)
        elif isinstance(msg, Abort):
            if not self.done:
                self._finish_aborted(msg.code, msg.reason, remote=True)
        else:
            raise InvalidInput(f"{type(msg).__name__} is not a message a transfer receiver accepts")

    def abort(self, code: ErrorCode, reason: str, now: float) -> None:
        """Give up locally (no room, cancelled); tells the sender on the last connection it used."""
        if self.done:
            return
        if self._last_conn is not None:
            gen = max(self.generation, 0)
            self._out = [Outgoing(self._last_conn, Abort(self.transfer_id, gen, code, reason[:250]))]
        self._finish_aborted(code, reason, remote=False)

    def handle_timer(self, now: float) -> None:
        if self.done or now < self.deadline:
            return
        if self.begin is None:
            reason = f"chunks of transfer {self.transfer_id} came but no TransferBegin within the timeout"
        else:
            reason = (
                f"transfer {self.transfer_id} ({self.begin.total_bytes} bytes) missed its deadline: "
                f"{len(self._above) + self._next_index}/{self.begin.num_chunks} chunks held"
            )
        self.abort(ErrorCode.DEADLINE_EXCEEDED, reason, now)

    # --- outputs ------------------------------------------------------------------------------

    def messages_to_send(self, now: float) -> list[Outgoing]:
        out, self._out = self._out, []
        return out

    def next_event(self) -> TransferEvent | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        return None if self.done else self.deadline

    @property
    def done(self) -> bool:
        return self.state in (ReceiverState.COMPLETED, ReceiverState.ABORTED)

    @property
    def data(self) -> memoryview:
        """The assembled bytes (complete once the state is COMPLETED; empty if not assembling)."""
        return memoryview(self._data).toreadonly()

    @property
    def next_index(self) -> int:
        return self._next_index

    # --- internals ----------------------------------------------------------------------------

    def _on_begin(self, begin: TransferBegin, conn_id: int, now: float) -> None:
        if self.begin is None:
            self._start(begin, now)
            if self.done:
                return
            if begin.generation > 0:
                self._out.append(Outgoing(conn_id, Resume(self.transfer_id, begin.generation, 0, ())))
            self._replay_early(conn_id, now)
            return
        if begin.generation < self.generation or self.state is ReceiverState.ABORTED:
            return
        if begin.generation == self.generation and begin.generation == 0:
            return  # a duplicate first begin needs no answer
        if (begin.total_bytes, begin.chunk_bytes) != (self.begin.total_bytes, self.begin.chunk_bytes):
            self.abort(ErrorCode.PROTOCOL, "resumed transfer changed its size or chunking", now)
            return
        self.generation = begin.generation
        received = tuple(sorted(self._above))[:MAX_ACK_RANGE]
        resume = Resume(self.transfer_id, self.generation, self._next_index, received)
        self._out.append(Outgoing(conn_id, resume))
        if self.state is ReceiverState.COMPLETED and self._end is not None:
            self._out.append(Outgoing(conn_id, self._end_echo()))

    def _start(self, begin: TransferBegin, now: float) -> None:
        self.begin = begin
        self.generation = begin.generation
        self.deadline = now + begin.deadline_ms / 1000.0
        if begin.total_bytes > self.config.max_transfer_bytes:
            limit = self.config.max_transfer_bytes
            self.abort(ErrorCode.CAPACITY, f"transfer of {begin.total_bytes} bytes above limit {limit}", now)
            return
        n = begin.num_chunks
        self._held = bytearray(n)
        self._checksums = [0] * n
        if self.config.assemble:
            self._data = bytearray(begin.total_bytes)
        self.state = ReceiverState.RECEIVING
        self._events.append(TransferStarted(self.transfer_id, begin))

    def _replay_early(self, conn_id: int, now: float) -> None:
        early, self._early, self._early_bytes = self._early, [], 0
        for chunk, conn in early:
            self._on_chunk(chunk, conn, now)
        resend = tuple(sorted(i for i in self._early_dropped if i < len(self._held) and not self._held[i]))
        self._early_dropped.clear()
        if resend and not self.done:
            self._out.append(Outgoing(conn_id, self._ack(resend=resend)))
        if self._end is not None:
            self._on_end(self._end, conn_id, now)

    def _on_chunk(self, chunk: Chunk, conn_id: int, now: float) -> None:
        if self.done:
            return
        if self.begin is None:
            self._hold_early(chunk, conn_id)
            return
        if chunk.generation != self.generation:
            self.stats.stale_chunks += 1
            return
        problem = self._chunk_problem(chunk)
        if problem is not None:
            self.abort(ErrorCode.PROTOCOL, problem, now)
            return
        if self._held[chunk.index]:
            self.stats.duplicate_chunks += 1
            return
        if chunk_checksum(chunk.payload) != chunk.checksum:
            self._on_corrupt(chunk, conn_id, now)
            return
        self._store(chunk)
        self._out.append(Outgoing(conn_id, self._ack()))
        self._maybe_complete(conn_id, now)

    def _hold_early(self, chunk: Chunk, conn_id: int) -> None:
        size = len(chunk.payload)
        if self._early_bytes + size > self.config.max_early_bytes:
            self._early_dropped.add(chunk.index)  # asked for again once the begin arrives
            return
        self._early.append((chunk, conn_id))
        self._early_bytes += size

    def _chunk_problem(self, chunk: Chunk) -> str | None:
        assert self.begin is not None
        n, size = self.begin.num_chunks, self.begin.chunk_bytes
        if chunk.index >= n:
            return f"chunk {chunk.index} beyond the transfer's {n} chunks"
        expected = min(size, self.begin.total_bytes - chunk.index * size)
        if chunk.offset != chunk.index * size or len(chunk.payload) != expected:
            return (
                f"chunk {chunk.index} at offset {chunk.offset} with {len(chunk.payload)} bytes does not fit"
            )
        return None

    def _on_corrupt(self, chunk: Chunk, conn_id: int, now: float) -> None:
        self.stats.corrupt_chunks += 1
        attempt = self._failures[chunk.index] = self._failures.get(chunk.index, 0) + 1
        self._events.append(ChunkCorrupted(self.transfer_id, chunk.index, attempt))
        if attempt > self.config.max_chunk_retries:
            self.abort(ErrorCode.INTEGRITY, f"chunk {chunk.index} arrived corrupt {attempt} times", now)
            return
        self._out.append(Outgoing(conn_id, self._ack(resend=(chunk.index,))))

    def _store(self, chunk: Chunk) -> None:
        index = chunk.index
        if self.config.assemble:
            self._data[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        self._held[index] = 1
        self._checksums[index] = chunk.checksum
        self.stats.chunks_received += 1
        self.stats.bytes_received += len(chunk.payload)
        self._above.add(index)
        while self._next_index < len(self._held) and self._held[self._next_index]:
            self._above.discard(self._next_index)
            self._next_index += 1
        payload = chunk.payload if isinstance(chunk.payload, memoryview) else memoryview(chunk.payload)
        self._events.append(ChunkReceived(self.transfer_id, index, chunk.offset, payload))

    def _ack(self, resend: tuple[int, ...] = ()) -> Ack:
        received = tuple(sorted(self._above)[: self.config.max_selective_acks])
        return Ack(self.transfer_id, self.generation, self._next_index, received, resend)

    def _on_end(self, end: TransferEnd, conn_id: int, now: float) -> None:
        if self.done:
            return
        self._end = end
        if self.begin is None:
            return  # checked once the begin arrives
        if end.num_chunks != self.begin.num_chunks:
            reason = f"TransferEnd says {end.num_chunks} chunks, TransferBegin {self.begin.num_chunks}"
            self.abort(ErrorCode.PROTOCOL, reason, now)
            return
        self._maybe_complete(conn_id, now)

    def _maybe_complete(self, conn_id: int, now: float) -> None:
        if self.state is not ReceiverState.RECEIVING or self._end is None:
            return
        if self._next_index < len(self._held):
            return
        digest = transfer_digest(self._checksums)
        if digest != self._end.digest:
            self.abort(ErrorCode.INTEGRITY, "transfer digest mismatch: chunk checksums do not add up", now)
            return
        self.state = ReceiverState.COMPLETED
        self._out.append(Outgoing(conn_id, self._end_echo()))
        assert self.begin is not None
        done = TransferCompleted(self.transfer_id, self.begin.total_bytes, digest, now - self._started)
        self._events.append(done)

    def _end_echo(self) -> TransferEnd:
        assert self.begin is not None and self._end is not None
        return TransferEnd(self.transfer_id, self.generation, self.begin.num_chunks, self._end.digest)

    def _finish_aborted(self, code: ErrorCode, reason: str, *, remote: bool) -> None:
        if remote:
            self._out = []
        self.state = ReceiverState.ABORTED
        self._early = []
        self._events.append(TransferAborted(self.transfer_id, code, reason, remote))
