"""The sending side of one KV transfer, as a sans-I/O state machine.

Theory of operation. The bytes are cut into chunks of ``chunk_bytes`` (zero-copy memoryview slices).
On creation the sender queues ``TransferBegin`` (generation 0) and then streams chunks at once, over
all its striped connections (each chunk goes on the connection with the fewest bytes in flight),
as long as the bytes sent but not yet acknowledged fit ``window_bytes``. Acks are cumulative plus a
selective list; an ack may also ask for chunks that arrived corrupt, which are queued again. When
every chunk is sent it queues ``TransferEnd`` with the digest; the transfer is complete when the
receiver echoes ``TransferEnd`` with the same digest.

Resume. When a connection is lost, chunks in flight are in doubt: the sender bumps its generation,
sends ``TransferBegin`` of the new generation on a live connection (or waits for
``connection_made``) and stops sending until the receiver's ``Resume`` says what it holds (asking
again every ``resume_retry_s`` if no answer comes, e.g. a stream reset without a loss). It then
sends only the chunks the receiver lacks: acknowledged data is never sent twice, and anything still
on the wire from the old generation is ignored by the receiver. Deadline: ``handle_timer`` past
``deadline`` aborts (event + ``Abort`` to the peer).

States: SENDING -> (RESUMING | PAUSED)* -> SENDING ... -> COMPLETED | ABORTED.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from pddlink.errors import ErrorCode, InvalidInput
from pddlink.transfer.config import TransferConfig, TransferManifest, chunk_checksum, transfer_digest
from pddlink.transfer.events import (
    Outgoing,
    TransferAborted,
    TransferCompleted,
    TransferEvent,
    TransferResumed,
)
from pddlink.wire.frame import WireMessage
from pddlink.wire.transfer_messages import Abort, Ack, Chunk, Resume, TransferBegin, TransferEnd


class SenderState(Enum):
    SENDING = "sending"
    RESUMING = "resuming"  # TransferBegin of a new generation sent, waiting for Resume
    PAUSED = "paused"  # no live connection
    COMPLETED = "completed"
    ABORTED = "aborted"


@dataclass(slots=True)
class SenderStats:
    chunks_sent: int = 0
    bytes_sent: int = 0
    chunks_resent: int = 0
    bytes_resent: int = 0
    stale_messages: int = 0


class TransferSender:
    """Sends ``data`` as transfer ``transfer_id``; see the module docstring."""

    def __init__(
        self,
        transfer_id: int,
        manifest: TransferManifest,
        data: bytes | bytearray | memoryview,
        *,
        config: TransferConfig,
        deadline: float,
        connections: Iterable[int],
        now: float,
    ) -> None:
        self.transfer_id = transfer_id
        self.manifest = manifest
        self.config = config
        self.deadline = deadline
        self.generation = 0
        self.state = SenderState.SENDING
        self.stats = SenderStats()
        self._data = memoryview(data).cast("B")
        self._started = now
        n = -(-len(self._data) // config.chunk_bytes)
        self.num_chunks = n
        self._checksums: list[int | None] = [None] * n
        self._acked = bytearray(n)
        self._num_acked = 0
        self._cum_acked = 0  # every chunk below this index is acknowledged
        self._ever_sent = bytearray(n)
        self._queue = list(range(n))  # a heap: lowest index first
        self._queued = set(self._queue)
        self._in_flight: dict[int, int] = {}  # chunk index -> connection id
        self._conn_bytes: dict[int, int] = dict.fromkeys(connections, 0)
        self._end_sent = False
        self._resume_retry_at = float("inf")
        self._out: list[Outgoing] = []
        self._events: deque[TransferEvent] = deque()
        if not math.isfinite(deadline):
            raise InvalidInput(f"transfer deadline must be finite, got {deadline}")
        self._begin_message(now)  # validates ids, sizes and manifest before anything is queued
        self._begin(now)

    # --- inputs -------------------------------------------------------------------------------

    def receive(self, msg: WireMessage, now: float) -> None:
        """A message of this transfer arrived (on any connection)."""
        if getattr(msg, "transfer_id", None) != self.transfer_id:
            raise InvalidInput(f"{type(msg).__name__} is not for transfer {self.transfer_id}")
        if self.done:
            return
        if isinstance(msg, Ack):
            self._on_ack(msg)
        elif isinstance(msg, Resume):
            self._on_resume(msg)
        elif isinstance(msg, TransferEnd):
            self._on_end_echo(msg, now)
        elif isinstance(msg, Abort):
            self._finish_aborted(msg.code, msg.reason, remote=True)
        else:
            raise InvalidInput(f"{type(msg).__name__} is not a message a transfer sender accepts")

    def connection_lost(self, conn_id: int, now: float) -> None:
        if self._conn_bytes.pop(conn_id, None) is None:
            return
        self._out = [o for o in self._out if o.conn_id != conn_id]
        if not self.done:
            self._new_generation(now)

    def connection_made(self, conn_id: int, now: float) -> None:
        if conn_id in self._conn_bytes:
            return
        self._conn_bytes[conn_id] = 0
        if self.state is SenderState.PAUSED:
            self._begin(now)

    def abort(self, code: ErrorCode, reason: str, now: float) -> None:
        """Give up locally (cancelled, peer gone); tells the peer if a connection is live."""
        if not self.done:
            self._send_abort(code, reason)
            self._finish_aborted(code, reason, remote=False)

    def handle_timer(self, now: float) -> None:
        if self.state is SenderState.RESUMING and now >= self._resume_retry_at and now < self.deadline:
            self._begin(now)  # the begin or its answer went missing without a connection loss
            return
        if not self.done and now >= self.deadline:
            reason = (
                f"transfer {self.transfer_id} ({len(self._data)} bytes) missed its deadline: "
                f"{self._num_acked}/{self.num_chunks} chunks acknowledged"
            )
            self.abort(ErrorCode.DEADLINE_EXCEEDED, reason, now)

    # --- outputs ------------------------------------------------------------------------------

    def messages_to_send(self, now: float) -> list[Outgoing]:
        """Everything to send now: control messages, then chunks as far as the window allows."""
        if self.state is SenderState.SENDING:
            self._fill_window()
        out, self._out = self._out, []
        return out

    def next_event(self) -> TransferEvent | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        if self.state is SenderState.RESUMING:
            return min(self.deadline, self._resume_retry_at)
        return None if self.done else self.deadline

    @property
    def done(self) -> bool:
        return self.state in (SenderState.COMPLETED, SenderState.ABORTED)

    @property
    def bytes_in_flight(self) -> int:
        return sum(self._conn_bytes.values())

    @property
    def acked_chunks(self) -> int:
        return self._num_acked

    def is_acked(self, index: int) -> bool:
        """Whether the receiver has acknowledged chunk ``index`` (it is never sent again)."""
        return 0 <= index < self.num_chunks and bool(self._acked[index])

    # --- internals ----------------------------------------------------------------------------

    def _chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.config.chunk_bytes
        return start, min(start + self.config.chunk_bytes, len(self._data))

    def _checksum(self, index: int) -> int:
        cs = self._checksums[index]
        if cs is None:
            start, end = self._chunk_range(index)
            cs = self._checksums[index] = chunk_checksum(self._data[start:end])
        return cs

    def _begin(self, now: float) -> None:
        """Send TransferBegin of the current generation on the first live connection."""
        if not self._conn_bytes:
            self.state = SenderState.PAUSED
            return
        self._out.append(Outgoing(min(self._conn_bytes), self._begin_message(now)))
        self.state = SenderState.SENDING if self.generation == 0 else SenderState.RESUMING
        self._resume_retry_at = now + self.config.resume_retry_s

    def _begin_message(self, now: float) -> TransferBegin:
        m = self.manifest
        remaining_ms = max(0, min(int((self.deadline - now) * 1000), 2**32 - 1))
        return TransferBegin(
            self.transfer_id, self.generation, m.request_id, m.layout, m.first_block, m.num_tokens,
            m.block_hashes, m.codec, len(self._data), self.config.chunk_bytes, remaining_ms,
        )  # fmt: skip

    def _new_generation(self, now: float) -> None:
        self.generation += 1
        for conn in self._conn_bytes:
            self._conn_bytes[conn] = 0
        self._in_flight.clear()
        self._out = [o for o in self._out if not isinstance(o.message, Chunk)]
        self._begin(now)

    def _fill_window(self) -> None:
        window = self.config.window_bytes
        in_flight = self.bytes_in_flight
        while self._queue:
            index = self._queue[0]
            start, end = self._chunk_range(index)
            if in_flight and in_flight + (end - start) > window:
                break
            heapq.heappop(self._queue)
            self._queued.discard(index)
            if self._acked[index] or index in self._in_flight:
                continue
            self._send_chunk(index, start, end)
            in_flight += end - start
        if not self._queue and not self._end_sent and self._conn_bytes:
            self._end_sent = True
            digest = transfer_digest(self._checksum(i) for i in range(self.num_chunks))
            end_msg = TransferEnd(self.transfer_id, self.generation, self.num_chunks, digest)
            self._out.append(Outgoing(min(self._conn_bytes), end_msg))

    def _send_chunk(self, index: int, start: int, end: int) -> None:
        conn = min(self._conn_bytes, key=lambda c: (self._conn_bytes[c], c))
        payload = self._data[start:end]
        chunk = Chunk(self.transfer_id, self.generation, index, start, self._checksum(index), payload)
        self._out.append(Outgoing(conn, chunk))
        self._in_flight[index] = conn
        self._conn_bytes[conn] += end - start
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += end - start
        if self._ever_sent[index]:
            self.stats.chunks_resent += 1
            self.stats.bytes_resent += end - start
        self._ever_sent[index] = 1

    def _mark_acked(self, index: int) -> None:
        if index >= self.num_chunks or self._acked[index]:
            return
        self._acked[index] = 1
        self._num_acked += 1
        conn = self._in_flight.pop(index, None)
        if conn is not None and conn in self._conn_bytes:
            start, end = self._chunk_range(index)
            self._conn_bytes[conn] -= end - start

    def _apply_acks(self, next_index: int, received: Iterable[int]) -> None:
        if next_index > self.num_chunks:
            reason = f"ack of chunk {next_index - 1} beyond {self.num_chunks}"
            self._send_abort(ErrorCode.PROTOCOL, reason)
            self._finish_aborted(ErrorCode.PROTOCOL, reason, remote=False)
            return
        for i in range(self._cum_acked, next_index):
            self._mark_acked(i)
        for i in received:
            self._mark_acked(i)
        while self._cum_acked < self.num_chunks and self._acked[self._cum_acked]:
            self._cum_acked += 1

    def _on_ack(self, ack: Ack) -> None:
        if ack.generation != self.generation or self.state is not SenderState.SENDING:
            self.stats.stale_messages += 1
            return
        self._apply_acks(ack.next_index, ack.received)
        if self.done:
            return
        for index in ack.resend:
            if index < self.num_chunks and not self._acked[index]:
                self._requeue(index)

    def _requeue(self, index: int) -> None:
        conn = self._in_flight.pop(index, None)
        if conn is not None and conn in self._conn_bytes:
            start, end = self._chunk_range(index)
            self._conn_bytes[conn] -= end - start
        if index not in self._queued:
            heapq.heappush(self._queue, index)
            self._queued.add(index)

    def _on_resume(self, resume: Resume) -> None:
        if resume.generation != self.generation or self.state is not SenderState.RESUMING:
            self.stats.stale_messages += 1
            return
        held = set(resume.received)
        lost = [i for i in range(resume.next_index, self.num_chunks) if self._acked[i] and i not in held]
        if lost:
            # The receiver lost state (restarted): acknowledged data is never sent again, so this
            # transfer cannot finish; the caller may start a fresh one.
            reason = f"receiver no longer holds acknowledged chunk {lost[0]} (lost its state?)"
            self._send_abort(ErrorCode.PROTOCOL, reason)
            self._finish_aborted(ErrorCode.PROTOCOL, reason, remote=False)
            return
        self._apply_acks(resume.next_index, resume.received)
        if self.done:
            return
        self._queue = [i for i in range(self.num_chunks) if not self._acked[i]]
        self._queued = set(self._queue)
        self._end_sent = False
        self.state = SenderState.SENDING
        self._events.append(
            TransferResumed(self.transfer_id, self.generation, resume.next_index, len(self._queue))
        )

    def _on_end_echo(self, end: TransferEnd, now: float) -> None:
        digest = transfer_digest(self._checksum(i) for i in range(self.num_chunks))
        if end.num_chunks != self.num_chunks or end.digest != digest:
            self.abort(ErrorCode.INTEGRITY, "receiver's transfer digest differs from the data sent", now)
            return
        for i in range(self.num_chunks):
            self._mark_acked(i)
        self.state = SenderState.COMPLETED
        self._out = []
        self._events.append(TransferCompleted(self.transfer_id, len(self._data), digest, now - self._started))

    def _send_abort(self, code: ErrorCode, reason: str) -> None:
        self._out = []
        if self._conn_bytes:
            abort = Abort(self.transfer_id, self.generation, code, reason[:250])
            self._out.append(Outgoing(min(self._conn_bytes), abort))

    def _finish_aborted(self, code: ErrorCode, reason: str, *, remote: bool) -> None:
        if remote:
            self._out = []
        self.state = SenderState.ABORTED
        self._events.append(TransferAborted(self.transfer_id, code, reason, remote))
