"""Transfer configuration and the receiver's limits: bad values refused, oversize and orphan
transfers ended with a reason, early chunks beyond the budget asked for again."""

from __future__ import annotations

import pytest

from pddlink.errors import ConfigError, ErrorCode, InvalidInput
from pddlink.transfer import (
    Outgoing,
    ReceiverState,
    TransferAborted,
    TransferConfig,
    TransferEvent,
    TransferManifest,
    TransferReceiver,
    TransferSender,
    chunk_checksum,
    transfer_digest,
)
from pddlink.wire import Ack, Chunk, KVLayoutSpec, Ping, TransferBegin

LAYOUT = KVLayoutSpec("tiny", 1, 1, 4, "float16", 4)


def events(side: TransferReceiver | TransferSender) -> list[TransferEvent]:
    out = []
    while (ev := side.next_event()) is not None:
        out.append(ev)
    return out


def begin(total: int, chunk: int = 100, deadline_ms: int = 5000) -> TransferBegin:
    return TransferBegin(1, 0, "r", LAYOUT, 0, 4, (), 0, total, chunk, deadline_ms)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_bytes": 0},
        {"chunk_bytes": 2**32},
        {"chunk_bytes": 1000, "window_bytes": 999},
        {"begin_timeout_s": 0.0},
        {"begin_timeout_s": float("nan")},
        {"max_chunk_retries": -1},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        TransferConfig(**kwargs)  # type: ignore[arg-type]


def test_manifest_validation() -> None:
    with pytest.raises(InvalidInput):
        TransferManifest("r", LAYOUT, (), num_tokens=-1)
    assert TransferManifest("r", LAYOUT, [1, 2], num_tokens=8).block_hashes == (1, 2)  # type: ignore[arg-type]


def test_oversize_transfer_is_refused_with_capacity() -> None:
    rx = TransferReceiver(1, config=TransferConfig(chunk_bytes=100, max_transfer_bytes=1000), now=0.0)
    rx.receive(begin(5000), 3, 0.0)
    assert rx.state is ReceiverState.ABORTED
    (out,) = rx.messages_to_send(0.0)
    assert out.conn_id == 3 and out.message.code is ErrorCode.CAPACITY  # type: ignore[attr-defined]
    (ev,) = events(rx)
    assert isinstance(ev, TransferAborted) and "above limit" in ev.reason


def test_chunks_without_a_begin_time_out() -> None:
    rx = TransferReceiver(1, config=TransferConfig(chunk_bytes=100, begin_timeout_s=2.0), now=0.0)
    rx.receive(Chunk(1, 0, 0, 0, chunk_checksum(b"a" * 100), b"a" * 100), 1, 0.0)
    assert rx.get_timer() == 2.0
    rx.handle_timer(2.0)
    (ev,) = events(rx)
    assert isinstance(ev, TransferAborted) and ev.code is ErrorCode.DEADLINE_EXCEEDED
    assert "no TransferBegin" in ev.reason


def test_early_chunks_beyond_the_budget_are_asked_for_again() -> None:
    rx = TransferReceiver(1, config=TransferConfig(chunk_bytes=100, max_early_bytes=250), now=0.0)
    payloads = [bytes([i]) * 100 for i in range(4)]
    for i, p in enumerate(payloads):
        rx.receive(Chunk(1, 0, i, i * 100, chunk_checksum(p), p), 1, 0.0)
    rx.receive(begin(400), 2, 0.0)
    outs: list[Outgoing] = rx.messages_to_send(0.0)
    acks = [o.message for o in outs if isinstance(o.message, Ack)]
    assert acks[-1].next_index == 2 and acks[-1].resend == (2, 3)


def test_corrupt_chunk_beyond_retry_budget_aborts_with_integrity() -> None:
    rx = TransferReceiver(1, config=TransferConfig(chunk_bytes=100, max_chunk_retries=2), now=0.0)
    rx.receive(begin(100), 1, 0.0)
    for _ in range(3):
        rx.receive(Chunk(1, 0, 0, 0, 12345, b"z" * 100), 1, 0.0)
    aborted = [e for e in events(rx) if isinstance(e, TransferAborted)]
    assert aborted and aborted[0].code is ErrorCode.INTEGRITY


def test_digest_mismatch_aborts_with_integrity() -> None:
    from pddlink.wire import TransferEnd

    rx = TransferReceiver(1, config=TransferConfig(chunk_bytes=100), now=0.0)
    rx.receive(begin(100), 1, 0.0)
    payload = b"q" * 100
    rx.receive(Chunk(1, 0, 0, 0, chunk_checksum(payload), payload), 1, 0.0)
    rx.receive(TransferEnd(1, 0, 1, transfer_digest([chunk_checksum(payload)]) ^ 1), 1, 0.0)
    aborted = [e for e in events(rx) if isinstance(e, TransferAborted)]
    assert aborted and aborted[0].code is ErrorCode.INTEGRITY


def test_messages_of_other_kinds_are_refused() -> None:
    rx = TransferReceiver(1, config=TransferConfig(), now=0.0)
    with pytest.raises(InvalidInput):
        rx.receive(Ping(1, 1), 1, 0.0)
    tx = TransferSender(
        1,
        TransferManifest("r", LAYOUT, (), 4),
        b"x",
        config=TransferConfig(),
        deadline=1.0,
        connections=[1],
        now=0,
    )
    with pytest.raises(InvalidInput):
        tx.receive(Ping(1, 1), 0.0)


def test_sender_without_connections_waits_paused_until_one_is_made() -> None:
    tx = TransferSender(
        1, TransferManifest("r", LAYOUT, (), 4), b"x" * 10, config=TransferConfig(), deadline=5.0,
        connections=[], now=0.0,
    )  # fmt: skip
    assert tx.messages_to_send(0.0) == []
    tx.connection_made(4, 0.1)
    outs = tx.messages_to_send(0.1)
    assert [type(o.message).__name__ for o in outs] == ["TransferBegin", "Chunk", "TransferEnd"]
    assert {o.conn_id for o in outs} == {4}


def test_ack_beyond_the_last_chunk_aborts_the_sender() -> None:
    tx = TransferSender(
        1, TransferManifest("r", LAYOUT, (), 4), b"x" * 250, config=TransferConfig(chunk_bytes=100),
        deadline=5.0, connections=[1], now=0.0,
    )  # fmt: skip
    tx.messages_to_send(0.0)
    tx.receive(Ack(1, 0, 9, (), (1,)), 0.0)
    (ev,) = events(tx)
    assert isinstance(ev, TransferAborted) and ev.code is ErrorCode.PROTOCOL
    (out,) = tx.messages_to_send(0.0)
    assert type(out.message).__name__ == "Abort"


def test_messages_of_another_transfer_are_refused_without_state_change() -> None:
    rx = TransferReceiver(1, config=TransferConfig(chunk_bytes=100), now=0.0)
    rx.receive(begin(300), 1, 0.0)
    with pytest.raises(InvalidInput):
        rx.receive(Chunk(2, 0, 0, 0, chunk_checksum(b"a" * 100), b"a" * 100), 1, 0.0)
    assert rx.next_index == 0 and rx.stats.chunks_received == 0
    tx = TransferSender(
        1, TransferManifest("r", LAYOUT, (), 4), b"x" * 300, config=TransferConfig(chunk_bytes=100),
        deadline=5.0, connections=[1], now=0.0,
    )  # fmt: skip
    tx.messages_to_send(0.0)
    with pytest.raises(InvalidInput):
        tx.receive(Ack(2, 0, 3), 0.0)
    assert tx.acked_chunks == 0


@pytest.mark.parametrize("transfer_id", [-1, 2**64])
def test_sender_refuses_bad_ids_up_front(transfer_id: int) -> None:
    with pytest.raises(InvalidInput):
        TransferSender(
            transfer_id, TransferManifest("r", LAYOUT, (), 4), b"x", config=TransferConfig(),
            deadline=5.0, connections=[], now=0.0,
        )  # fmt: skip
