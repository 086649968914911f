"""Faults on real sockets: a stripe cut mid-transfer, a stalled path, wrong certificates/identities.

The link goes through ``TcpRelay`` (real sockets) so a connection can be reset for real without
reaching into the transport.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from pddlink.errors import ErrorCode, PddlinkError
from pddlink.transport import KVClient, KVServer, LinkOptions, PeerIdentity, ReceivedTransfer
from pddlink.wire import KVLayoutSpec, TransferBegin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
LAYOUT = KVLayoutSpec("test/model", 2, 2, 64, "bf16", 16)
CHUNK = 256 << 10
OPTIONS = LinkOptions(chunk_bytes=CHUNK, window_bytes=4 << 20, reconnect_backoff_s=0.05)


def begin(transfer_id: int, size: int, deadline_ms: int = 20_000) -> TransferBegin:
    return TransferBegin(transfer_id, 0, f"req-{transfer_id}", LAYOUT, 0, 16, (), 0, size, CHUNK, deadline_ms)


def test_cut_stripe_resumes_on_the_others_without_resending_held_chunks(
    pki: Any, run_async: Any, relay_factory: Any
) -> None:
    data = random.Random(5).randbytes(48 << 20)

    async def scenario() -> tuple[Any, list[ReceivedTransfer], list[int]]:
        got: list[ReceivedTransfer] = []
        server = await KVServer.start(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], on_transfer=got.append, options=OPTIONS
        )
        relay = relay_factory(server.port)
        port = await relay.start()
        client = await KVClient.connect(
            "127.0.0.1", port, identity=CLIENT, tls=pki[CLIENT], streams=4, options=OPTIONS
        )
        try:
            sending = asyncio.ensure_future(client.send_transfer(begin(1, len(data)), data, deadline_s=20.0))
            while sum(relay.forwarded[1:]) < len(data) // 4:  # relayed connection 0 is control
                await asyncio.sleep(0.002)
                assert not sending.done()
            busiest = max(range(1, len(relay.pairs)), key=lambda i: relay.forwarded[i])
            relay.cut(busiest)
            result = await sending
            return result, got, relay.forwarded
        finally:
            await client.close()
            await relay.close()
            await server.close()

    result, got, forwarded = run_async(scenario)
    assert len(got) == 1 and b"".join(bytes(c) for c in got[0].chunks) == data
    assert result.reconnects >= 1  # the cut forced a resume (new generation)
    assert got[0].duplicate_chunks == 0  # nothing the receiver held was sent again
    assert result.resent_chunks < (4 << 20) // CHUNK + 4  # at most the window was in doubt
    assert len(forwarded) >= 5  # 4 stripes + control, plus the reconnected stripe


def test_path_stalled_past_the_deadline_aborts_with_reason_on_both_sides(
    pki: Any, run_async: Any, relay_factory: Any
) -> None:
    data = random.Random(6).randbytes(16 << 20)

    async def scenario() -> tuple[PddlinkError, list[tuple[Any, PddlinkError]], float]:
        failed: list[tuple[Any, PddlinkError]] = []
        server = await KVServer.start(
            "127.0.0.1",
            0,
            identity=SERVER,
            tls=pki[SERVER],
            options=OPTIONS,
            on_transfer_failed=lambda peer, b, err: failed.append((b, err)),
        )
        relay = relay_factory(server.port)
        port = await relay.start()
        client = await KVClient.connect("127.0.0.1", port, identity=CLIENT, tls=pki[CLIENT], options=OPTIONS)
        relay.running.clear()  # the path stops carrying bytes: nothing is reset, nothing arrives
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            with pytest.raises(PddlinkError) as info:
                await client.send_transfer(begin(1, len(data), deadline_ms=800), data, deadline_s=0.8)
            elapsed = loop.time() - t0
            relay.running.set()  # the receiver learns of the transfer late and times out on its own clock
            for _ in range(400):
                if failed:
                    break
                await asyncio.sleep(0.01)
            return info.value, failed, elapsed
        finally:
            await client.close()
            await relay.close()
            await server.close()

    error, failed, elapsed = run_async(scenario)
    assert error.code == ErrorCode.DEADLINE_EXCEEDED and "deadline" in error.message
    assert 0.7 < elapsed < 3.0
    assert failed and failed[0][1].code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED)


def _refused(
    pki_client: Any,
    client_identity: PeerIdentity,
    server_tls: Any,
    expected: PeerIdentity | None,
    run_async: Any,
) -> tuple[PddlinkError, int]:
    async def scenario() -> tuple[PddlinkError, int]:
        got: list[ReceivedTransfer] = []
        server = await KVServer.start("127.0.0.1", 0, identity=SERVER, tls=server_tls, on_transfer=got.append)
        try:
            with pytest.raises(PddlinkError) as info:
                client = await KVClient.connect(
                    "127.0.0.1",
                    server.port,
                    identity=client_identity,
                    tls=pki_client,
                    expected_peer=expected,
                    options=LinkOptions(connect_timeout_s=5.0),
                )
                await client.close()
            await asyncio.sleep(0.05)
            return info.value, len(got) + len(server.links())
        finally:
            await server.close()

    result: tuple[PddlinkError, int] = run_async(scenario)
    return result


def test_certificate_from_another_ca_is_refused(pki: Any, foreign_pki: Any, run_async: Any) -> None:
    error, links = _refused(foreign_pki[CLIENT], CLIENT, pki[SERVER], SERVER, run_async)
    assert error.code in (ErrorCode.PEER_UNREACHABLE, ErrorCode.AUTH) and links == 0


def test_server_with_certificate_from_another_ca_is_refused(
    pki: Any, foreign_pki: Any, run_async: Any
) -> None:
    error, links = _refused(pki[CLIENT], CLIENT, foreign_pki[SERVER], SERVER, run_async)
    assert error.code in (ErrorCode.PEER_UNREACHABLE, ErrorCode.AUTH) and links == 0
    assert "certificate" in error.message.lower()


def test_identity_claim_differing_from_certificate_is_refused(pki: Any, run_async: Any) -> None:
    # p1's certificate, claiming to be p0 in its hello
    error, links = _refused(pki[PeerIdentity("p", "p1")], CLIENT, pki[SERVER], SERVER, run_async)
    assert error.code == ErrorCode.AUTH and "certificate" in error.message and links == 0


def test_unexpected_server_identity_is_refused(pki: Any, run_async: Any) -> None:
    error, links = _refused(pki[CLIENT], CLIENT, pki[SERVER], PeerIdentity("md", "md9"), run_async)
    assert error.code == ErrorCode.AUTH and "md9" in error.message and links == 0


def test_cut_control_connection_is_reopened_and_the_link_keeps_working(
    pki: Any, run_async: Any, relay_factory: Any
) -> None:
    from pddlink.wire import Ping, Pong

    data = random.Random(7).randbytes(3 << 20)

    async def scenario() -> tuple[Any, Any, int, list[ReceivedTransfer]]:
        got: list[ReceivedTransfer] = []
        server = await KVServer.start(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], on_transfer=got.append, options=OPTIONS
        )
        relay = relay_factory(server.port)
        port = await relay.start()
        client = await KVClient.connect("127.0.0.1", port, identity=CLIENT, tls=pki[CLIENT], options=OPTIONS)
        try:
            relay.cut(0)  # the control connection (opened first)
            await asyncio.sleep(0.01)  # the link notices; the request then waits for the reconnect
            pong = await client.request(Ping(3, 4), timeout_s=5.0)
            result = await client.send_transfer(begin(1, len(data)), data, deadline_s=10.0)
            await asyncio.sleep(0.05)
            return pong, result, len(server.links()), got
        finally:
            await client.close()
            await relay.close()
            await server.close()

    pong, result, links, got = run_async(scenario)
    assert isinstance(pong, Pong) and pong.nonce == 3
    assert result.bytes == len(data) and links == 1  # one session: the new control joined the old one
    assert len(got) == 1


def test_a_connect_given_up_mid_handshake_leaves_no_socket_or_task_behind(run_async: Any) -> None:
    """A peer that accepts and never answers the hello (a WAN cut after the SYN): the caller gives the
    connect up (``wait_for``, as ``KVPeer.client`` does at its deadline). Its socket must close then
    (the peer sees EOF), and nothing of that handshake may stay pending. Both used to outlive it, one
    per attempt (measured in the WAN-outage runs: "Task was destroyed but it is pending", and the
    server's handlers still reading)."""

    async def go() -> tuple[int, list[asyncio.Task[Any]]]:
        eofs: list[bytes] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # reads the hello, answers nothing, until the client closes
            eofs.append(b"")
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            for _ in range(3):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(
                        KVClient.connect("127.0.0.1", port, identity=CLIENT, tls=None, options=OPTIONS), 0.3
                    )
            for _ in range(50):
                if len(eofs) == 3:
                    break
                await asyncio.sleep(0.02)
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
            return len(eofs), left
        finally:
            server.close()

    closed, left = run_async(go)
    assert closed == 3, "a given-up connect left its socket open"
    assert not [t for t in left if "Queue.get" in repr(t)], left
