"""Striped TCP over real loopback sockets with TLS 1.3 mutual auth: transfers, control messages."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from pddlink.errors import PddlinkError
from pddlink.transport import KVClient, KVServer, LinkOptions, PeerIdentity, ReceivedTransfer
from pddlink.wire import KVLayoutSpec, Ping, Pong, Reserve, ReserveAnswer, TransferBegin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
LAYOUT = KVLayoutSpec("test/model", 2, 2, 64, "bf16", 16)
OPTIONS = LinkOptions(chunk_bytes=1 << 20, window_bytes=8 << 20)


def begin(transfer_id: int, size: int, chunk_bytes: int = 1 << 20) -> TransferBegin:
    return TransferBegin(
        transfer_id, 0, f"req-{transfer_id}", LAYOUT, 0, 16, (transfer_id,), 0, size, chunk_bytes, 10_000
    )


async def start_pair(
    pki: dict[PeerIdentity, Any], streams: int, **server_kw: Any
) -> tuple[KVServer, KVClient]:
    server = await KVServer.start(
        "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], options=OPTIONS, **server_kw
    )
    client = await KVClient.connect(
        "127.0.0.1",
        server.port,
        identity=CLIENT,
        tls=pki[CLIENT],
        expected_peer=SERVER,
        streams=streams,
        options=OPTIONS,
    )
    return server, client


@pytest.mark.parametrize("streams", [1, 4])
def test_transfers_arrive_whole_and_in_order(pki: Any, run_async: Any, streams: int) -> None:
    payloads = [random.Random(i).randbytes(size) for i, size in enumerate((9 << 20, 1, 3 << 20))]

    async def scenario() -> list[ReceivedTransfer]:
        got: list[ReceivedTransfer] = []
        server, client = await start_pair(pki, streams, on_transfer=got.append)
        try:
            assert client.peer == SERVER
            for i, data in enumerate(payloads, start=1):
                result = await client.send_transfer(begin(i, len(data)), data, deadline_s=10.0)
                assert result.bytes == len(data) and result.resent_chunks == 0
            stats = client.stats()
            assert stats.streams == streams and stats.bytes_sent >= sum(map(len, payloads))
            return got
        finally:
            await client.close()
            await server.close()

    got = run_async(scenario)
    assert [b"".join(bytes(c) for c in r.chunks) for r in got] == payloads
    assert [r.begin.request_id for r in got] == ["req-1", "req-2", "req-3"]
    assert all(r.peer == CLIENT for r in got)


def test_control_messages_and_requests(pki: Any, run_async: Any) -> None:
    seen: list[Any] = []

    def on_message(peer: PeerIdentity, message: Any) -> Any:
        seen.append((peer, message))
        if isinstance(message, Reserve):
            return ReserveAnswer(message.request_id, reservation_id=7, cached_blocks=3, lease_ms=500)
        return None

    async def scenario() -> tuple[Any, Any]:
        server, client = await start_pair(pki, 2, on_message=on_message)
        try:
            pong = await client.request(Ping(42, 1000), timeout_s=5.0)
            answer = await client.request(Reserve("r1", (1, 2, 3), 500), timeout_s=5.0)
            await client.send_message(Ping(1, 1))  # answered by the link itself, not the handler
            return pong, answer
        finally:
            await client.close()
            await server.close()

    pong, answer = run_async(scenario)
    assert isinstance(pong, Pong) and pong.nonce == 42 and pong.ping_sent_ns == 1000
    assert isinstance(answer, ReserveAnswer) and answer.granted and answer.reservation_id == 7
    assert [type(m).__name__ for _, m in seen] == ["Reserve"] and seen[0][0] == CLIENT


def test_server_pushes_control_message_to_client(pki: Any, run_async: Any) -> None:
    async def scenario() -> list[Any]:
        pushed: list[Any] = []
        arrived = asyncio.Event()

        def on_client_message(peer: PeerIdentity, message: Any) -> None:
            pushed.append((peer, message))
            arrived.set()

        server = await KVServer.start("127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], options=OPTIONS)
        client = await KVClient.connect(
            "127.0.0.1",
            server.port,
            identity=CLIENT,
            tls=pki[CLIENT],
            on_message=on_client_message,
            options=OPTIONS,
        )
        try:
            (link,) = server.links()
            await link.send_message(Reserve("pushed", (9,), 100))
            await asyncio.wait_for(arrived.wait(), 5.0)
            return pushed
        finally:
            await client.close()
            await server.close()

    pushed = run_async(scenario)
    assert pushed[0][0] == SERVER and pushed[0][1].request_id == "pushed"


def test_bad_input_is_refused_without_state_change(pki: Any, run_async: Any) -> None:
    async def scenario() -> None:
        server, client = await start_pair(pki, 1)
        try:
            with pytest.raises(PddlinkError, match="total_bytes"):
                await client.send_transfer(begin(1, 100), b"x" * 99, deadline_s=5.0)
            result = await client.send_transfer(begin(1, 100), b"x" * 100, deadline_s=5.0)
            assert result.bytes == 100
        finally:
            await client.close()
            await server.close()

    run_async(scenario)
