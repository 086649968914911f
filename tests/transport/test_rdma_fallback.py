"""Transport "rdma" end to end over real loopback sockets (TLS 1.3, real processes where it matters).

This machine has no RDMA device, so asking for "rdma" must fall back to TCP for real and say why
(log, metric, ``fast_path``, stats): ``test_rdma_requested_here_*`` runs the receiver in another
process. The RDMA lane logic (set-up exchange, slot credits, a failure mid-transfer and the resume
on TCP) is exercised with ``MemoryChannel``, an in-process stand-in for the verbs channel: the one
part that needs hardware this machine lacks. The control link under it is real TCP in every test.
The verbs channel is tested in test_rdma.py, the link on verbs below: both skip without a device.

Run as ``python test_rdma_fallback.py serve CERT KEY CA`` it is the receiver process of the first
test: prints ``{"port": N}``, waits for one transfer, prints what it received and how.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from prometheus_client import REGISTRY

from pddlink.transport import Handlers, LinkOptions, PeerIdentity, ReceivedTransfer, TlsConfig, registry
from pddlink.transport.api import KVServer
from pddlink.transport.rdma import RdmaCompletion, RdmaConfig, RdmaError, rdma_available
from pddlink.transport.rdma_session import RdmaLink, RdmaProvider, RdmaReceivingSession, RdmaTransport
from pddlink.transport.tcp import TcpListener, TcpTransport
from pddlink.wire import RDMA_CAPABILITY, ChannelRole, KVLayoutSpec, PathMtu, RdmaEndpoint, TransferBegin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
LAYOUT = KVLayoutSpec("test/model", 2, 2, 64, "bf16", 16)
OPTIONS = LinkOptions(streams=2, chunk_bytes=256 << 10, window_bytes=2 << 20)
SIZE = 6 << 20 | 12345  # 25 chunks, the last one partial
DEVICE = rdma_available()
pytestmark = pytest.mark.timeout(120)


def begin(transfer_id: int, size: int = SIZE) -> TransferBegin:
    return TransferBegin(
        transfer_id,
        0,
        f"req-{transfer_id}",
        LAYOUT,
        0,
        16,
        (transfer_id,),
        0,
        size,
        OPTIONS.chunk_bytes,
        20_000,
    )


def fallbacks(kind: str) -> float:
    return REGISTRY.get_sample_value("pddlink_fallbacks_total", {"kind": kind}) or 0.0


# --- the receiver process ---------------------------------------------------------------------------


async def serve(tls: TlsConfig) -> None:
    done: asyncio.Future[ReceivedTransfer] = asyncio.get_running_loop().create_future()
    server = await KVServer.start(
        "127.0.0.1", 0, identity=tls.identity, tls=tls, transport="rdma", options=OPTIONS,
        on_transfer=lambda received: done.set_result(received) if not done.done() else None,
    )  # fmt: skip
    print(json.dumps({"port": server.port}), flush=True)
    try:
        received = await asyncio.wait_for(done, 60.0)
        (session,) = server.links()
        assert isinstance(session, RdmaReceivingSession) and session.fast_path is not None
        data = b"".join(received.chunks)
        report = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "path": session.fast_path.name,
            "reason": session.fast_path.reason,
            "transport": session.stats().transport,
            "fallbacks": fallbacks("rdma_local_unavailable"),
        }
        print(json.dumps(report), flush=True)
    finally:
        await server.close()


@pytest.mark.process
def test_rdma_requested_here_moves_the_payload_over_tcp_and_says_why(
    pki: dict[PeerIdentity, TlsConfig], run_async: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tls = pki[SERVER]
    child = subprocess.Popen(
        [sys.executable, __file__, "serve", str(tls.cert_file), str(tls.key_file), str(tls.ca_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = json.loads(child.stdout.readline())["port"]
        data = random.Random(5).randbytes(SIZE)
        before = fallbacks("rdma_local_unavailable")
        caplog.set_level(logging.DEBUG, logger="pddlink.transport.rdma_fastpath")  # logs decisions

        async def scenario() -> tuple[Any, Any, Any]:
            link = await registry.load("rdma").connect(
                "127.0.0.1", port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER,
                handlers=Handlers(), options=OPTIONS,
            )  # fmt: skip
            try:
                assert isinstance(link, RdmaLink)
                result = await link.send_transfer(begin(1), data, deadline_s=20.0)
                return result, link.fast_path, link.stats()
            finally:
                await link.close()

        result, choice, stats = run_async(scenario, 60.0)
        received = json.loads(child.stdout.readline())
        assert child.wait(timeout=20) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert result.bytes == SIZE
    assert received["bytes"] == SIZE and received["sha256"] == hashlib.sha256(data).hexdigest()
    # both sides name the real reason: no pyverbs here, or pyverbs without a device
    for reason in (choice.reason, received["reason"]):
        assert "RDMA fast path unavailable" in reason
        assert "pyverbs" in reason or "device" in reason
    assert choice.name == received["path"] == "tcp" and not choice.rdma_available
    assert stats.transport == received["transport"] == "tcp" and stats.extra["rdma"] == 0.0
    assert stats.streams == OPTIONS.streams  # the TCP stripes carried the chunks
    assert fallbacks("rdma_local_unavailable") == before + 1 and received["fallbacks"] == 1
    assert any(choice.reason in r.getMessage() for r in caplog.records)


# --- an in-process stand-in for the verbs channel ------------------------------------------------------


class MemoryFabric:
    """Queue pairs of one process by number; ``fail_write`` makes that write's completion fail."""

    def __init__(self, fail_write: int | None = None) -> None:
        self.channels: dict[int, MemoryChannel] = {}
        self.fail_write = fail_write
        self.writes = 0


class MemoryChannel:
    """``rdma_lanes.Channel`` over bytearrays: a write lands in the peer's region at once and raises
    one completion on each side, as RDMA WRITE WITH IMMEDIATE does."""

    def __init__(self, fabric: MemoryFabric, role: ChannelRole, config: RdmaConfig) -> None:
        self.fabric, self.role, self.config = fabric, role, config
        self.qp_num = len(fabric.channels) + 1
        fabric.channels[self.qp_num] = self
        self.region = bytearray(config.region_bytes if role is ChannelRole.RECEIVER else 0)
        self.cq: deque[RdmaCompletion | None] = deque()  # None: a failed completion
        self.peer: MemoryChannel | None = None
        self.receives = 0
        self._in_flight = 0
        self.closed = False

    def endpoint(self) -> RdmaEndpoint:
        rx = self.role is ChannelRole.RECEIVER
        return RdmaEndpoint(
            self.role, self.qp_num, 0, 0, 1, PathMtu.MTU_4096, bytes(16), rkey=self.qp_num if rx else 0,
            slots=self.config.slots if rx else 0, slot_bytes=self.config.slot_bytes if rx else 0,
        )  # fmt: skip

    def connect(self, peer: RdmaEndpoint) -> None:
        self.peer = self.fabric.channels[peer.qp_num]

    def post_receives(self, count: int) -> None:
        self.receives += count

    def write_frame(self, slot: int, parts: Sequence[bytes | memoryview], imm: int) -> None:
        assert self.peer is not None and not self.peer.closed
        data = b"".join(bytes(p) for p in parts)
        start = slot * self.peer.config.slot_bytes
        assert len(data) <= self.peer.config.slot_bytes and self.peer.receives > 0
        self.fabric.writes += 1
        self._in_flight += 1
        if self.fabric.writes == self.fabric.fail_write:
            self.cq.append(None)  # retry count exceeded: nothing lands
            return
        self.peer.region[start : start + len(data)] = data
        self.peer.receives -= 1
        self.peer.cq.append(RdmaCompletion(0, imm, len(data), True))
        self.cq.append(RdmaCompletion(slot, 0, len(data), False))

    def poll_nowait(self, max_completions: int = 16) -> list[RdmaCompletion]:
        out: list[RdmaCompletion] = []
        while self.cq and len(out) < max_completions:
            done = self.cq.popleft()
            if done is None:
                raise RdmaError("work completion failed with status 12 (retry exceeded)")
            if done.received:
                self.receives += 1  # the channel re-posts the receive
            else:
                self._in_flight -= 1
            out.append(done)
        return out

    def read_slot(self, slot: int, length: int) -> bytes:
        start = slot * self.config.slot_bytes
        return bytes(self.region[start : start + length])

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def close(self) -> None:
        self.closed = True


def memory_transport(fabric: MemoryFabric, timeout_s: float = 5.0) -> type[RdmaTransport]:
    class MemoryRdma(RdmaTransport):
        provider: ClassVar[RdmaProvider] = RdmaProvider(
            lambda: (True, "memory fabric"), lambda role, config: MemoryChannel(fabric, role, config)
        )
        setup_timeout_s: ClassVar[float] = timeout_s

    return MemoryRdma


async def open_pair(
    server_impl: Any, client_impl: Any, pki: dict[PeerIdentity, TlsConfig], got: list[ReceivedTransfer]
) -> tuple[Any, Any]:
    listener = await server_impl.listen(
        "127.0.0.1",
        0,
        identity=SERVER,
        tls=pki[SERVER],
        handlers=Handlers(on_transfer=got.append),
        options=OPTIONS,
    )
    link = await client_impl.connect(
        "127.0.0.1", listener.port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER,
        handlers=Handlers(), options=OPTIONS,
    )  # fmt: skip
    return listener, link


def test_with_rdma_on_both_sides_chunks_take_the_rdma_lane(pki: Any, run_async: Any) -> None:
    fabric = MemoryFabric()
    impl = memory_transport(fabric)
    data = bytes(range(256)) * (SIZE // 256 + 1)

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener, link = await open_pair(impl, impl, pki, got)
        try:
            assert link.fast_path.name == "rdma" and link.fast_path.rdma_available
            for transfer_id in (1, 2):
                result = await link.send_transfer(begin(transfer_id, len(data)), data, deadline_s=20.0)
                assert result.bytes == len(data) and result.resent_chunks == 0
            await asyncio.sleep(0.05)
            assert [b"".join(t.chunks) for t in got] == [data, data]
            stats = link.stats()
            chunks = 2 * begin(1, len(data)).num_chunks
            assert stats.transport == "rdma" and stats.extra["rdma_chunks"] == chunks
            assert link.data_connections() == []  # no TCP stripe was opened
            (session,) = listener.links()
            assert session.fast_path.name == "rdma" and session.stats().extra["rdma_chunks"] == chunks
            # the window is slots x slot_bytes: more chunks than slots went through, so credits worked
            assert chunks > link.setup.channel.config.slots and fabric.writes == chunks
        finally:
            await link.close()
            await listener.close()
        assert all(c.closed for c in fabric.channels.values())

    run_async(scenario)


@pytest.mark.skipif(not DEVICE[0], reason=f"RDMA fast path unavailable: {DEVICE[1]}")
def test_with_a_device_chunks_take_the_verbs_lane(pki: Any, run_async: Any) -> None:
    """The same link on real queue pairs (both ends on this host's device)."""
    data = random.Random(11).randbytes(SIZE)

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener, link = await open_pair(RdmaTransport, RdmaTransport, pki, got)
        try:
            assert link.fast_path.name == "rdma", link.fast_path.reason
            result = await link.send_transfer(begin(1, len(data)), data, deadline_s=20.0)
            await asyncio.sleep(0.05)
            assert result.bytes == len(data) and b"".join(got[0].chunks) == data
            assert link.stats().extra["rdma_chunks"] == begin(1, len(data)).num_chunks
        finally:
            await link.close()
            await listener.close()

    run_async(scenario)


def test_an_rdma_failure_mid_transfer_resumes_on_tcp(pki: Any, run_async: Any) -> None:
    fabric = MemoryFabric(fail_write=7)
    impl = memory_transport(fabric)
    data = bytes(range(251)) * (SIZE // 251)
    before = {kind: fallbacks(kind) for kind in ("rdma_local_failed", "rdma_peer_declined")}

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener, link = await open_pair(impl, impl, pki, got)
        try:
            assert link.fast_path.name == "rdma"
            result = await link.send_transfer(begin(1, len(data)), data, deadline_s=20.0)
            assert result.bytes == len(data) and result.reconnects >= 1
            await asyncio.sleep(0.05)
            assert b"".join(got[0].chunks) == data
            assert link.fast_path.name == "tcp" and "status 12" in link.fast_path.reason
            assert link.stats().transport == "tcp" and len(link.data_connections()) == OPTIONS.streams
            (session,) = listener.links()
            assert session.fast_path.name == "tcp" and "status 12" in session.fast_path.reason
        finally:
            await link.close()
            await listener.close()

    run_async(scenario)
    # the sender's completion failed; the receiver was told (in this process: both sides count)
    assert {kind: fallbacks(kind) - count for kind, count in before.items()} == {
        "rdma_local_failed": 1.0,
        "rdma_peer_declined": 1.0,
    }


def test_losing_the_control_connection_under_rdma_moves_the_link_to_tcp(
    pki: Any, run_async: Any, relay_factory: Any
) -> None:
    """Slot credits travel on the control connection: once it is cut, both sides leave RDMA."""
    impl = memory_transport(MemoryFabric())
    data = random.Random(7).randbytes(1 << 20)

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener = await impl.listen(
            "127.0.0.1",
            0,
            identity=SERVER,
            tls=pki[SERVER],
            handlers=Handlers(on_transfer=got.append),
            options=OPTIONS,
        )
        relay = relay_factory(listener.port)
        port = await relay.start()
        link = await impl.connect(
            "127.0.0.1", port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER,
            handlers=Handlers(), options=OPTIONS,
        )  # fmt: skip
        try:
            await link.send_transfer(begin(1, len(data)), data, deadline_s=10.0)
            assert link.fast_path.name == "rdma" and len(relay.pairs) == 1  # control only, no stripes
            relay.cut(0)
            result = await link.send_transfer(begin(2, len(data)), data, deadline_s=10.0)
            assert result.bytes == len(data)
            await asyncio.sleep(0.05)
            assert [b"".join(t.chunks) for t in got] == [data, data]
            assert link.fast_path.name == "tcp" and "control connection lost" in link.fast_path.reason
            assert len(link.data_connections()) == OPTIONS.streams and link.stats().transport == "tcp"
            for _ in range(100):  # the control connection comes back after its reconnect backoff
                if listener.links():
                    break
                await asyncio.sleep(0.05)
            (session,) = listener.links()
            assert session.fast_path.name == "tcp" and "control connection lost" in session.fast_path.reason
        finally:
            await link.close()
            await listener.close()
            await relay.close()

    run_async(scenario)


def test_a_peer_without_rdma1_gets_plain_tcp_both_ways(pki: Any, run_async: Any) -> None:
    impl = memory_transport(MemoryFabric())
    data = b"kv" * 100_000

    async def one_way(server_impl: Any, client_impl: Any) -> None:
        got: list[ReceivedTransfer] = []
        messages: list[Any] = []
        listener = await server_impl.listen(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], options=OPTIONS,
            handlers=Handlers(on_transfer=got.append, on_message=lambda peer, m: messages.append(m)),
        )  # fmt: skip
        link = await client_impl.connect(
            "127.0.0.1", listener.port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER,
            handlers=Handlers(on_message=lambda peer, m: messages.append(m)), options=OPTIONS,
        )  # fmt: skip
        try:
            await link.send_transfer(begin(1, len(data)), data, deadline_s=10.0)
            await asyncio.sleep(0.05)
            assert b"".join(got[0].chunks) == data and messages == []  # no RDMA message reached it
            rdma_side = link if client_impl is impl else listener.links()[0]
            assert rdma_side.fast_path.name == "tcp" and RDMA_CAPABILITY in rdma_side.fast_path.reason
        finally:
            await link.close()
            await listener.close()

    async def scenario() -> None:
        await one_way(TcpTransport, impl)  # an old or plain-TCP receiver
        await one_way(impl, TcpTransport)  # an old or plain-TCP sender

    run_async(scenario)


class SilentRdmaListener(TcpListener):
    """Offers rdma/1 in its hello but never answers the set-up (a peer stuck or too slow)."""

    capabilities = (RDMA_CAPABILITY,)


def test_a_silent_peer_falls_back_at_the_set_up_deadline(pki: Any, run_async: Any) -> None:
    impl = memory_transport(MemoryFabric(), timeout_s=0.4)
    before = fallbacks("rdma_setup_timeout")

    async def scenario() -> float:
        got: list[ReceivedTransfer] = []
        listener = SilentRdmaListener(SERVER, pki[SERVER], Handlers(on_transfer=got.append), OPTIONS)
        listener.server = await asyncio.get_running_loop().create_server(
            listener.connection, "127.0.0.1", 0, ssl=pki[SERVER].server_context()
        )
        started = time.monotonic()
        link = await impl.connect(
            "127.0.0.1", listener.port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER,
            handlers=Handlers(), options=OPTIONS,
        )  # fmt: skip
        waited = time.monotonic() - started
        try:
            assert link.fast_path.name == "tcp" and "within 0.4 s" in link.fast_path.reason
            await link.send_transfer(begin(1, 300_000), b"x" * 300_000, deadline_s=10.0)
            await asyncio.sleep(0.05)
            assert b"".join(got[0].chunks) == b"x" * 300_000
        finally:
            await link.close()
            await listener.close()
        return waited

    waited = run_async(scenario)
    assert 0.35 <= waited < 3.0
    assert fallbacks("rdma_setup_timeout") == before + 1


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    cert, key, ca = (Path(p) for p in sys.argv[2:5])
    asyncio.run(serve(TlsConfig(SERVER, cert, key, ca)))
