"""A TransferSender and a TransferReceiver wired together in memory, with an injected clock.

Every message crosses as real frame bytes (``pddlink.wire`` encoder, one decoder per connection and
direction), so what is asserted about re-sent bytes is counted on the wire, not inside the sender.
Faults (a lost connection, a flipped payload byte, a stale chunk, a black hole) are produced by the
harness on those bytes: there is no network here, so these are the only way to inject them exactly.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.errors import ErrorCode
from pddlink.transfer import (
    ChunkCorrupted,
    Outgoing,
    ReceiverState,
    SenderState,
    TransferAborted,
    TransferCompleted,
    TransferConfig,
    TransferEvent,
    TransferManifest,
    TransferReceiver,
    TransferResumed,
    TransferSender,
    chunk_checksum,
)
from pddlink.wire import Chunk, Decoder, KVLayoutSpec, WireMessage, encode_parts

LAYOUT = KVLayoutSpec("tiny", 2, 2, 8, "bfloat16", 16)
TID = 77


def make_data(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


class Link:
    """Connections between one sender and one receiver; each carries frames in both directions."""

    def __init__(
        self,
        data: bytes,
        *,
        conns: tuple[int, ...] = (1, 2, 3),
        chunk: int = 1000,
        window: int = 4000,
        deadline: float = 60.0,
        shuffle_seed: int | None = 0,
    ) -> None:
        self.now = 0.0
        self.config = TransferConfig(chunk_bytes=chunk, window_bytes=window)
        manifest = TransferManifest("req-1", LAYOUT, (1, 2, 3), num_tokens=48)
        self.sender = TransferSender(
            TID, manifest, data, config=self.config, deadline=deadline, connections=conns, now=self.now
        )
        self.receiver = TransferReceiver(TID, config=self.config, now=self.now)
        self.to_rx: dict[int, deque[bytes]] = {c: deque() for c in conns}
        self.to_tx: dict[int, deque[bytes]] = {c: deque() for c in conns}
        self.rx_dec = {c: Decoder() for c in conns}
        self.tx_dec = {c: Decoder() for c in conns}
        self.rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
        self.chunks_on_wire: list[Chunk] = []  # every chunk the sender put on a connection
        self.tamper: Callable[[Chunk, bytes], bytes] | None = None
        self.tx_events: list[TransferEvent] = []
        self.rx_events: list[TransferEvent] = []

    def _frame(self, msg: WireMessage) -> bytes:
        head, payload = encode_parts(msg)
        return head + bytes(payload)

    def pump_sender(self) -> None:
        acked = {i for i in range(self.sender.num_chunks) if self.sender.is_acked(i)}
        for out in self.sender.messages_to_send(self.now):
            frame = self._frame(out.message)
            if isinstance(out.message, Chunk):
                assert out.message.index not in acked, f"acknowledged chunk {out.message.index} sent again"
                self.chunks_on_wire.append(out.message)
                if self.tamper is not None:
                    frame = self.tamper(out.message, frame)
            self.to_rx[out.conn_id].append(frame)
        while (ev := self.sender.next_event()) is not None:
            self.tx_events.append(ev)

    def pump_receiver(self) -> None:
        for out in self.receiver.messages_to_send(self.now):
            if out.conn_id in self.to_tx:
                self.to_tx[out.conn_id].append(self._frame(out.message))
        while (ev := self.receiver.next_event()) is not None:
            self.rx_events.append(ev)

    def deliver(self, limit: int = 10**9) -> int:
        """Deliver up to ``limit`` frames to the receiver (in a shuffled order across connections)
        and every frame back to the sender. Returns frames delivered to the receiver."""
        delivered = 0
        while delivered < limit:
            ready = [c for c, q in self.to_rx.items() if q]
            if not ready:
                break
            conn = self.rng.choice(ready) if self.rng else ready[0]
            for msg in self.rx_dec[conn].feed(self.to_rx[conn].popleft()):
                self.receiver.receive(msg, conn, self.now)
            delivered += 1
            self.pump_receiver()
        for conn, q in self.to_tx.items():
            while q:
                for msg in self.tx_dec[conn].feed(q.popleft()):
                    self.sender.receive(msg, self.now)
        return delivered

    def run(self, rounds: int = 10_000) -> None:
        for _ in range(rounds):
            self.pump_sender()
            if not self.deliver() and not any(self.to_tx.values()):
                self.pump_sender()
                if not any(self.to_rx.values()):
                    return

    def lose(self, conn: int) -> list[bytes]:
        """The connection breaks: frames on it are gone (returned, for replaying stale ones)."""
        lost = list(self.to_rx.pop(conn))
        del self.to_tx[conn], self.rx_dec[conn], self.tx_dec[conn]
        self.sender.connection_lost(conn, self.now)
        return lost

    def connect(self, conn: int) -> None:
        self.to_rx[conn], self.to_tx[conn] = deque(), deque()
        self.rx_dec[conn], self.tx_dec[conn] = Decoder(), Decoder()
        self.sender.connection_made(conn, self.now)

    def sent_indices(self) -> list[int]:
        return [c.index for c in self.chunks_on_wire]


def completed(events: list[TransferEvent]) -> list[TransferCompleted]:
    return [e for e in events if isinstance(e, TransferCompleted)]


def test_striped_out_of_order_transfer_completes_intact() -> None:
    data = make_data(25_500)
    link = Link(data, conns=(1, 2, 3, 4))
    link.run()
    assert link.sender.state is SenderState.COMPLETED
    assert link.receiver.state is ReceiverState.COMPLETED
    assert bytes(link.receiver.data) == data
    assert len(completed(link.tx_events)) == len(completed(link.rx_events)) == 1
    assert sorted(link.sent_indices()) == list(range(26))  # each chunk sent exactly once


def test_chunks_are_striped_over_every_connection() -> None:
    link = Link(make_data(8000), conns=(1, 2, 3, 4), window=8000)
    outs: list[Outgoing] = link.sender.messages_to_send(0.0)
    conns_used = {o.conn_id for o in outs if isinstance(o.message, Chunk)}
    assert conns_used == {1, 2, 3, 4}


def test_window_bounds_bytes_in_flight() -> None:
    link = Link(make_data(20_000), window=3000)
    outs = link.sender.messages_to_send(0.0)
    assert sum(len(o.message.payload) for o in outs if isinstance(o.message, Chunk)) == 3000
    assert link.sender.bytes_in_flight == 3000
    assert link.sender.messages_to_send(0.0) == []  # nothing more until acks


def test_connection_lost_resumes_from_last_ack_without_resending_acked_bytes() -> None:
    data = make_data(30_000)
    link = Link(data, conns=(1, 2), window=6000)
    link.pump_sender()
    link.deliver(limit=5)  # Begin + 4 chunks reach the receiver and are acknowledged
    link.pump_sender()
    acked_before = link.sender.acked_chunks
    assert 0 < acked_before < 30
    acked_set = {i for i in range(30) if link.receiver.next_index > i}
    sent_before = len(link.chunks_on_wire)
    link.lose(1)
    link.lose(2)
    assert link.sender.state is SenderState.PAUSED
    link.connect(5)
    link.run()
    assert link.receiver.state is ReceiverState.COMPLETED and bytes(link.receiver.data) == data
    resent = link.sent_indices()[sent_before:]
    assert not acked_set & set(resent), "an acknowledged chunk went on the wire again"
    resumed = [e for e in link.tx_events if isinstance(e, TransferResumed)]
    assert len(resumed) == 1 and resumed[0].generation == 2  # one new generation per lost connection
    assert resumed[0].next_index == len(acked_set)
    # everything re-sent was in doubt (sent, not acknowledged) when the connections broke
    resent_again = [i for i in resent if i in set(link.sent_indices()[:sent_before])]
    assert link.sender.stats.chunks_resent == len(resent_again)
    assert link.sender.stats.bytes_resent <= 6000


def test_resume_skips_chunks_the_receiver_holds_but_never_acked() -> None:
    data = make_data(10_000)
    link = Link(data, conns=(1,), window=10_000)
    link.pump_sender()
    link.deliver(limit=6)  # 5 chunks arrive; their acks are lost with the connection below
    link.to_tx[1].clear()
    link.lose(1)
    link.connect(2)
    link.run()
    assert bytes(link.receiver.data) == data
    assert link.sender.stats.chunks_resent == 5  # only the 5 that never arrived
    assert link.receiver.stats.duplicate_chunks == 0


def test_a_lost_resume_begin_is_sent_again_after_resume_retry() -> None:
    data = make_data(5000)
    link = Link(data, conns=(1, 2))
    link.pump_sender()
    link.lose(1)
    assert link.sender.state is SenderState.RESUMING
    link.pump_sender()
    link.to_rx[2].clear()  # the new-generation begin vanishes without any connection loss
    retry_at = link.sender.get_timer()
    assert retry_at is not None and retry_at < 60.0
    link.now = retry_at
    link.sender.handle_timer(link.now)
    link.run()
    assert link.receiver.state is ReceiverState.COMPLETED and bytes(link.receiver.data) == data


def test_corrupt_chunk_is_detected_and_requested_again() -> None:
    data = make_data(12_000)
    link = Link(data)
    hit: set[int] = set()

    def flip_payload_byte(chunk: Chunk, frame: bytes) -> bytes:
        if chunk.index in (3, 7) and chunk.index not in hit:
            hit.add(chunk.index)
            raw = bytearray(frame)
            raw[-10] ^= 0x40  # payload bytes are protected by the chunk checksum, not the frame CRC
            return bytes(raw)
        return frame

    link.tamper = flip_payload_byte
    link.run()
    assert bytes(link.receiver.data) == data
    corrupt = sorted(e.index for e in link.rx_events if isinstance(e, ChunkCorrupted))
    assert corrupt == [3, 7]
    assert sorted(link.sent_indices()).count(3) == 2 and sorted(link.sent_indices()).count(7) == 2
    assert link.receiver.stats.corrupt_chunks == 2


def test_chunk_from_older_generation_is_ignored() -> None:
    data = make_data(8000)
    link = Link(data, conns=(1,), window=8000)
    link.pump_sender()
    old_frames = link.lose(1)  # Begin + 8 gen-0 chunks + End, never delivered in time
    link.connect(2)
    link.pump_sender()
    link.deliver()  # Begin gen 1 -> Resume (receiver holds nothing)
    # a late gen-0 chunk with other bytes (and a checksum matching them) must not touch the data
    forged = Chunk(TID, 0, 2, 2000, chunk_checksum(b"\xff" * 1000), b"\xff" * 1000)
    link.receiver.receive(forged, 2, link.now)
    for frame in old_frames:
        for msg in Decoder().feed(frame):
            link.receiver.receive(msg, 2, link.now)
    assert link.receiver.stats.stale_chunks == 1 + 8
    assert link.receiver.next_index == 0
    link.run()
    assert link.receiver.state is ReceiverState.COMPLETED
    assert bytes(link.receiver.data) == data


def test_stale_chunk_during_transfer_does_not_count() -> None:
    data = make_data(6000)
    link = Link(data, conns=(1,), window=3000)
    link.pump_sender()
    old = link.lose(1)
    link.connect(2)
    link.pump_sender()
    link.deliver()  # Begin gen 1 reaches the receiver before the stale frames
    for frame in old:
        for msg in Decoder().feed(frame):
            link.receiver.receive(msg, 2, link.now)
    assert link.receiver.next_index == 0  # gen-0 chunks arrived after the new begin: ignored
    link.run()
    assert bytes(link.receiver.data) == data


def test_deadline_aborts_both_sides_with_reason() -> None:
    link = Link(make_data(50_000), deadline=2.0)
    link.pump_sender()
    link.deliver(limit=3)  # the begin and a couple of chunks arrive, then the path goes dark
    for q in link.to_rx.values():
        q.clear()
    link.now = 1.0
    link.sender.handle_timer(link.now)
    link.receiver.handle_timer(link.now)
    assert not link.sender.done and not link.receiver.done
    assert link.sender.get_timer() == 2.0
    link.now = 2.5
    for side in (link.sender, link.receiver):
        timer = side.get_timer()
        assert timer is not None and timer <= link.now
        side.handle_timer(link.now)
    link.pump_sender()
    link.pump_receiver()
    for events in (link.tx_events, link.rx_events):
        aborts = [e for e in events if isinstance(e, TransferAborted)]
        assert len(aborts) == 1 and aborts[0].code is ErrorCode.DEADLINE_EXCEEDED
        assert "deadline" in aborts[0].reason and not aborts[0].remote
    assert link.sender.get_timer() is None and link.receiver.get_timer() is None


def test_abort_reaches_the_peer() -> None:
    link = Link(make_data(9000))
    link.pump_sender()
    link.deliver(limit=2)
    link.sender.abort(ErrorCode.CANCELLED, "client went away", link.now)
    link.run()
    aborts = [e for e in link.rx_events if isinstance(e, TransferAborted)]
    assert aborts and aborts[0].remote and aborts[0].code is ErrorCode.CANCELLED
    assert aborts[0].reason == "client went away"


def test_chunks_before_begin_are_held_until_it_arrives() -> None:
    data = make_data(5000)
    link = Link(data, conns=(1, 2))
    outs = link.sender.messages_to_send(0.0)
    begin = outs[0]
    for out in reversed(outs[1:]):  # every chunk (and the end) overtakes the begin
        link.receiver.receive(out.message, out.conn_id, 0.0)
    assert link.receiver.state is ReceiverState.AWAIT_BEGIN
    link.receiver.receive(begin.message, begin.conn_id, 0.0)
    assert link.receiver.next_index == 4  # the early chunks were replayed
    link.pump_receiver()
    link.run()
    assert link.sender.stats.chunks_resent == 0
    assert link.receiver.state is ReceiverState.COMPLETED
    assert bytes(link.receiver.data) == data


def test_misfit_chunk_aborts_with_protocol_error() -> None:
    link = Link(make_data(3000), shuffle_seed=None)
    link.pump_sender()
    link.deliver(limit=1)  # the begin
    assert link.receiver.state is ReceiverState.RECEIVING
    link.receiver.receive(Chunk(TID, 0, 9, 9000, 0, b"x"), 1, 0.0)
    link.pump_receiver()
    aborts = [e for e in link.rx_events if isinstance(e, TransferAborted)]
    assert aborts and aborts[0].code is ErrorCode.PROTOCOL and "chunk 9" in aborts[0].reason
    link.deliver()
    assert link.sender.messages_to_send(0.0) == []
    assert link.sender.state is SenderState.ABORTED


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001])
def test_edge_sizes(size: int) -> None:
    data = make_data(size)
    link = Link(data)
    link.run()
    assert link.receiver.state is ReceiverState.COMPLETED
    assert bytes(link.receiver.data) == data


# --- random fault schedules ----------------------------------------------------------------------

OPS = ("deliver", "deliver", "deliver", "deliver", "pump", "lose", "corrupt", "stale")


@settings(max_examples=120, deadline=None)
@given(
    size=st.integers(0, 12_000),
    conns=st.integers(1, 4),
    seed=st.integers(0, 2**32),
    schedule=st.lists(st.sampled_from(OPS), max_size=80),
)
def test_any_fault_schedule_ends_complete_and_intact(
    size: int, conns: int, seed: int, schedule: list[str]
) -> None:
    """Random interleavings of delivery, lost connections, corrupt payloads and replayed stale
    frames: once the faults stop the transfer completes with the exact bytes, and (checked in
    ``pump_sender``) no acknowledged chunk is ever put on the wire again."""
    data = make_data(size, seed)
    link = Link(data, conns=tuple(range(1, conns + 1)), window=3000, shuffle_seed=seed)
    rng = random.Random(seed)
    next_conn = conns + 1
    corrupt_next = 0
    stale: list[bytes] = []

    def tamper(chunk: Chunk, frame: bytes) -> bytes:
        nonlocal corrupt_next
        if corrupt_next and chunk.payload:
            corrupt_next -= 1
            raw = bytearray(frame)
            raw[-1] ^= 0x01
            return bytes(raw)
        return frame

    link.tamper = tamper
    for op in schedule:
        if op == "deliver":
            link.deliver(limit=1)
        elif op == "pump":
            link.pump_sender()
        elif op == "lose" and link.to_rx:
            stale += link.lose(rng.choice(sorted(link.to_rx)))
            if not link.to_rx or rng.random() < 0.5:
                link.connect(next_conn)
                next_conn += 1
        elif op == "corrupt":
            corrupt_next = min(corrupt_next + 1, 3)
        elif op == "stale" and stale and link.to_rx:
            conn = rng.choice(sorted(link.to_rx))
            link.to_rx[conn].append(stale.pop(rng.randrange(len(stale))))
    if not link.to_rx:
        link.connect(next_conn)
    link.run()
    assert link.sender.state is SenderState.COMPLETED, link.tx_events
    assert link.receiver.state is ReceiverState.COMPLETED, link.rx_events
    assert bytes(link.receiver.data) == data
    assert link.sender.stats.bytes_resent <= link.sender.stats.bytes_sent - size


def test_receiver_that_lost_acknowledged_chunks_makes_the_sender_abort_at_once() -> None:
    link = Link(make_data(6000), conns=(1,), window=6000)
    link.pump_sender()
    link.deliver(limit=4)  # the begin and three chunks arrive and are acknowledged
    assert link.sender.acked_chunks == 3
    link.lose(1)
    link.receiver = TransferReceiver(TID, config=link.config, now=link.now)  # a restarted receiver
    link.connect(2)
    link.run()
    aborts = [e for e in link.tx_events if isinstance(e, TransferAborted)]
    assert aborts and aborts[0].code is ErrorCode.PROTOCOL and "no longer holds" in aborts[0].reason
