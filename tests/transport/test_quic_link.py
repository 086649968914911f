"""QUIC over real loopback UDP sockets, TLS 1.3 + client auth, with both qh3 and aioquic."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from pddlink.errors import ErrorCode, PddlinkError
from pddlink.transport import KVClient, KVServer, LinkOptions, PeerIdentity, ReceivedTransfer
from pddlink.transport.quic import QuicTransport
from pddlink.wire import KVLayoutSpec, Ping, Pong, TransferBegin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
LAYOUT = KVLayoutSpec("test/model", 2, 2, 64, "bf16", 16)
OPTIONS = LinkOptions(chunk_bytes=256 << 10, max_datagram_bytes=8952, connect_timeout_s=5.0)


@pytest.fixture(params=["qh3", "aioquic"])
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    pytest.importorskip(request.param)
    QuicTransport.impl = request.param
    yield request.param
    QuicTransport.impl = "auto"


def test_transfers_and_control_over_quic(pki: Any, run_async: Any, impl: str) -> None:
    payloads = [random.Random(i).randbytes(n) for i, n in enumerate((3 << 20, 5, 700_001))]

    async def scenario() -> tuple[list[ReceivedTransfer], Any]:
        got: list[ReceivedTransfer] = []
        server = await KVServer.start(
            "127.0.0.1",
            0,
            identity=SERVER,
            tls=pki[SERVER],
            transport="quic",
            on_transfer=got.append,
            options=OPTIONS,
        )
        client = await KVClient.connect(
            "127.0.0.1",
            server.port,
            identity=CLIENT,
            tls=pki[CLIENT],
            transport="quic",
            expected_peer=SERVER,
            options=OPTIONS,
        )
        try:
            assert client.peer == SERVER and client.transport == "quic"
            for i, data in enumerate(payloads, start=1):
                begin = TransferBegin(i, 0, f"q{i}", LAYOUT, 0, 1, (), 0, len(data), 256 << 10, 10_000)
                result = await client.send_transfer(begin, data, deadline_s=10.0)
                assert result.bytes == len(data)
            pong = await client.request(Ping(5, 6), timeout_s=5.0)
            return got, pong
        finally:
            await client.close()
            await server.close()

    got, pong = run_async(scenario)
    assert [b"".join(bytes(c) for c in r.chunks) for r in got] == payloads
    assert all(r.peer == CLIENT for r in got)
    assert isinstance(pong, Pong) and pong.nonce == 5


def _connect_refused(
    server_tls: Any, client_tls: Any, identity: PeerIdentity, expected: PeerIdentity | None, run_async: Any
) -> tuple[PddlinkError, int]:
    async def scenario() -> tuple[PddlinkError, int]:
        got: list[ReceivedTransfer] = []
        server = await KVServer.start(
            "127.0.0.1",
            0,
            identity=SERVER,
            tls=server_tls,
            transport="quic",
            on_transfer=got.append,
            options=OPTIONS,
        )
        try:
            with pytest.raises(PddlinkError) as info:
                client = await KVClient.connect(
                    "127.0.0.1",
                    server.port,
                    identity=identity,
                    tls=client_tls,
                    transport="quic",
                    expected_peer=expected,
                    options=OPTIONS,
                )
                await client.close()
            return info.value, len(got) + len(server.links())
        finally:
            await server.close()

    result: tuple[PddlinkError, int] = run_async(scenario)
    return result


def test_client_from_another_ca_is_refused(pki: Any, foreign_pki: Any, run_async: Any, impl: str) -> None:
    error, links = _connect_refused(pki[SERVER], foreign_pki[CLIENT], CLIENT, SERVER, run_async)
    assert error.code == ErrorCode.AUTH and "CA" in error.message and links == 0


def test_server_from_another_ca_is_refused(pki: Any, foreign_pki: Any, run_async: Any, impl: str) -> None:
    error, links = _connect_refused(foreign_pki[SERVER], pki[CLIENT], CLIENT, SERVER, run_async)
    assert error.code == ErrorCode.AUTH and "CA" in error.message and links == 0


def test_claim_differing_from_certificate_is_refused(pki: Any, run_async: Any, impl: str) -> None:
    error, links = _connect_refused(pki[SERVER], pki[PeerIdentity("p", "p1")], CLIENT, SERVER, run_async)
    assert error.code == ErrorCode.AUTH and links == 0
