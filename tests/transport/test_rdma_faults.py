"""Transport "rdma" when its fast path breaks: every failure ends on TCP with the payload whole.

Same stand-in as test_rdma_fallback.py (``MemoryChannel``: the verbs channel this machine has no
device for), here made to fail the ways a verbs provider can: ``open_channel`` or ``connect``
raising ``RdmaError`` or an untyped exception, a poll task dying on an unexpected exception, a
peer crediting slots it was never written. The control link and the TCP stripes are real sockets
with TLS 1.3. Each test compares the ``pddlink_fallbacks`` metric before and after.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, ClassVar

import pytest
from test_rdma_fallback import (
    CLIENT,
    OPTIONS,
    SERVER,
    SIZE,
    MemoryChannel,
    MemoryFabric,
    begin,
    fallbacks,
    memory_transport,
    open_pair,
)

from pddlink.errors import LocalError
from pddlink.transport import Handlers, ReceivedTransfer
from pddlink.transport.rdma import RdmaCompletion, RdmaConfig, RdmaError
from pddlink.transport.rdma_lanes import RdmaSendLane
from pddlink.transport.rdma_session import RdmaProvider, RdmaTransport
from pddlink.wire import ChannelRole, Chunk, RdmaEndpoint

pytestmark = pytest.mark.timeout(120)
KINDS = ("local_unavailable", "local_failed", "peer_declined", "setup_timeout", "protocol")


def counts() -> dict[str, float]:
    return {kind: fallbacks(f"rdma_{kind}") for kind in KINDS}


def grown(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counts().items() if v != before[k]}


class FaultyChannel(MemoryChannel):
    """``fault`` names the call that raises ``error``: "connect", or "poll" once ``after`` writes
    have happened on the fabric."""

    fault: ClassVar[str] = ""
    error: ClassVar[BaseException] = RuntimeError("boom")
    after: ClassVar[int] = 0

    def connect(self, peer: RdmaEndpoint) -> None:
        if self.fault == "connect":
            raise self.error
        super().connect(peer)

    def poll_nowait(self, max_completions: int = 16) -> list[RdmaCompletion]:
        if self.fault == "poll" and self.fabric.writes >= self.after:
            raise self.error
        return super().poll_nowait(max_completions)


def faulty_transport(
    fabric: MemoryFabric, fault: str, error: BaseException, *, after: int = 0
) -> type[RdmaTransport]:
    channel = type("Faulty", (FaultyChannel,), {"fault": fault, "error": error, "after": after})

    def open_channel(role: ChannelRole, config: RdmaConfig) -> MemoryChannel:
        if fault == "open_channel":
            raise error
        return channel(fabric, role, config)  # type: ignore[no-any-return]

    def available() -> tuple[bool, str]:
        if fault == "available":
            raise error
        return True, "memory fabric"

    class Faulty(RdmaTransport):
        provider: ClassVar[RdmaProvider] = RdmaProvider(available, open_channel)
        setup_timeout_s: ClassVar[float] = 2.0

    return Faulty


async def transfer_whole(listener: Any, link: Any, got: list[ReceivedTransfer], size: int = SIZE) -> None:
    data = random.Random(size).randbytes(size)
    result = await link.send_transfer(begin(1, size), data, deadline_s=15.0)
    assert result.bytes == size
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.02)
    assert b"".join(got[0].chunks) == data


SET_UP_FAULTS = [
    # (side, fault, error, the failing side's fallback kind)
    ("sender", "open_channel", RuntimeError("no such verbs object"), "local_unavailable"),
    ("receiver", "open_channel", RuntimeError("no such verbs object"), "local_unavailable"),
    ("sender", "open_channel", RdmaError("register MR failed: Errno 12"), "local_unavailable"),
    ("receiver", "available", KeyError("sysfs"), "local_unavailable"),
    ("sender", "connect", RuntimeError("modify QP: bad attribute"), "local_failed"),
    ("receiver", "connect", RdmaError("modify QP to RTS failed: Errno 22"), "local_failed"),
    ("receiver", "connect", ValueError("bad GID"), "local_failed"),
]


@pytest.mark.parametrize(("side", "fault", "error", "kind"), SET_UP_FAULTS)
def test_a_provider_failing_during_set_up_leaves_the_link_on_tcp(
    pki: Any, run_async: Any, side: str, fault: str, error: BaseException, kind: str
) -> None:
    fabric = MemoryFabric()
    good, bad = memory_transport(fabric), faulty_transport(fabric, fault, error)
    before = counts()

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        server, client = (bad, good) if side == "receiver" else (good, bad)
        listener, link = await open_pair(server, client, pki, got)
        try:
            (session,) = listener.links()
            failing, other = (session, link) if side == "receiver" else (link, session)
            for end in (failing, other):
                assert end.fast_path.name == "tcp"
            assert str(error.args[0]) in failing.fast_path.reason
            assert "peer declined RDMA" in other.fast_path.reason
            await transfer_whole(listener, link, got)
            assert link.stats().transport == "tcp" and len(link.data_connections()) == OPTIONS.streams
        finally:
            await link.close()
            await listener.close()
        assert all(c.closed for c in fabric.channels.values())  # what was opened was closed

    run_async(scenario, 60.0)
    assert grown(before) == {kind: 1.0, "peer_declined": 1.0}


@pytest.mark.parametrize("side", ["sender", "receiver"])
@pytest.mark.parametrize("error", [RuntimeError("CQ went away"), RdmaError("poll CQ failed: Errno 5")])
def test_a_poll_task_dying_mid_transfer_moves_the_link_to_tcp(
    pki: Any, run_async: Any, side: str, error: BaseException
) -> None:
    fabric = MemoryFabric()
    good, bad = memory_transport(fabric), faulty_transport(fabric, "poll", error, after=5)
    before = counts()

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        server, client = (bad, good) if side == "receiver" else (good, bad)
        listener, link = await open_pair(server, client, pki, got)
        try:
            assert link.fast_path.name == "rdma"
            await transfer_whole(listener, link, got)
            assert link.fast_path.name == "tcp" and str(error.args[0]) in link.fast_path.reason + str(
                listener.links()[0].fast_path.reason
            )
            assert 5 <= fabric.writes < begin(1).num_chunks  # RDMA carried some, TCP the rest
            assert link.stats().transport == "tcp" and len(link.data_connections()) == OPTIONS.streams
        finally:
            await link.close()
            await listener.close()

    run_async(scenario, 60.0)
    assert grown(before) == {"local_failed": 1.0, "peer_declined": 1.0}


def test_credits_for_slots_not_in_use_are_ignored_and_counted() -> None:
    fabric = MemoryFabric()
    config = RdmaConfig(slots=2, slot_bytes=8192)
    receiver = MemoryChannel(fabric, ChannelRole.RECEIVER, config)
    sender = MemoryChannel(fabric, ChannelRole.SENDER, config)
    receiver.post_receives(config.slots)
    sender.connect(receiver.endpoint())
    control: list[Any] = []
    failures: list[str] = []
    lane = RdmaSendLane(sender, receiver.endpoint(), control.append, failures.append)

    def chunk(index: int) -> Chunk:
        return Chunk(1, 0, index, index * 1000, 0, bytes([index]) * 1000)

    for index in range(4):  # two fill both slots, two wait for credits
        lane.send(chunk(index))
    assert fabric.writes == 2
    while sender.poll_nowait() or receiver.poll_nowait():
        pass  # the writes completed: only credits hold the slots now
    lane.credit((1, 1, 7, 300))  # slot 1 once; then a duplicate, a slot outside, one far outside
    assert fabric.writes == 3 and lane.stray_credits == 3  # only one slot came back
    while sender.poll_nowait() or receiver.poll_nowait():
        pass
    lane.credit((1,))  # slot 1 carries chunk 2 now: in use again, so this frees it
    assert fabric.writes == 4 and lane.stray_credits == 3
    lane.credit((0, 0))  # slot 0 (chunk 0) once; the repeat is stray and frees nothing
    assert fabric.writes == 4 and lane.stray_credits == 4 and lane.chunks_written == 4
    assert control == [] and failures == []


def test_a_clean_close_under_rdma_counts_no_fallback(pki: Any, run_async: Any) -> None:
    impl = memory_transport(MemoryFabric())
    before = counts()

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener, link = await open_pair(impl, impl, pki, got)
        try:
            await transfer_whole(listener, link, got, 1 << 20)
            assert link.fast_path.name == "rdma"
            (session,) = listener.links()
            await link.close()
            for _ in range(50):  # the receiver sees the control connection go
                if not session.connected:
                    break
                await asyncio.sleep(0.02)
            assert not session.connected and session.stats().extra["rdma"] == 0.0
            await asyncio.sleep(0.1)
        finally:
            await link.close()
            await listener.close()

    run_async(scenario, 60.0)
    assert grown(before) == {}


def test_after_a_fallback_refused_stripes_are_retried_with_backoff(pki: Any, run_async: Any) -> None:
    """The listener stops accepting, RDMA fails mid-transfer: the first stripe dials are refused;
    the reconnect backoff opens them once the listener is back, and the transfer completes."""
    fabric = MemoryFabric(fail_write=4)
    impl = memory_transport(fabric)

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener, link = await open_pair(impl, impl, pki, got)
        port = listener.port
        try:
            assert link.fast_path.name == "rdma"
            listener.server.close()  # new connections are refused; the control one stays
            sending = asyncio.ensure_future(transfer_whole(listener, link, got))
            for _ in range(100):
                if link.fast_path.name == "tcp":
                    break
                await asyncio.sleep(0.01)
            assert link.fast_path.name == "tcp" and link.data_connections() == []
            await asyncio.sleep(0.1)  # the first dials have been refused by now
            listener.server = await asyncio.get_running_loop().create_server(
                listener.connection, "127.0.0.1", port, ssl=pki[listener.identity].server_context(),
                reuse_address=True,
            )  # fmt: skip
            await asyncio.wait_for(sending, 20.0)
            assert len(link.data_connections()) == OPTIONS.streams
        finally:
            await link.close()
            await listener.close()

    run_async(scenario, 60.0)


def test_a_connect_that_cannot_build_its_link_raises_typed_and_closes_the_control(
    pki: Any, run_async: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault inside the link's construction (forced here by making the set-up driver raise: no
    provider fault reaches it any more) must raise a typed error and close the control connection."""
    import pddlink.transport.rdma_session as session_module

    impl = memory_transport(MemoryFabric())

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener = await impl.listen(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], handlers=Handlers(on_transfer=got.append),
            options=OPTIONS,
        )  # fmt: skip

        def broken(*args: Any, **kwargs: Any) -> None:
            raise AttributeError("'NoneType' object has no attribute 'qp_num'")

        monkeypatch.setattr(session_module, "FastPathSetup", broken)
        try:
            with pytest.raises(LocalError, match="RDMA link set-up failed: AttributeError"):
                await impl.connect(
                    "127.0.0.1", listener.port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER,
                    handlers=Handlers(), options=OPTIONS,
                )  # fmt: skip
            for _ in range(100):  # the listener saw its control connection close
                if not listener.links():
                    break
                await asyncio.sleep(0.02)
            assert listener.links() == []
        finally:
            await listener.close()

    run_async(scenario, 60.0)


def test_a_listener_that_cannot_build_an_rdma_session_serves_the_link_over_tcp(
    pki: Any, run_async: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver's fast-path driver raising on construction (forced: no provider fault reaches it
    any more) must not kill the listener's greeting: the link is served over TCP, with the reason."""
    import pddlink.transport.rdma_session as session_module

    real = session_module.FastPathSetup
    broken: list[ChannelRole] = []

    def receiver_breaks_once(role: ChannelRole, *args: Any, **kwargs: Any) -> Any:
        if role is ChannelRole.RECEIVER and not broken:
            broken.append(role)
            raise AttributeError("'NoneType' object has no attribute 'qp_num'")
        return real(role, *args, **kwargs)

    monkeypatch.setattr(session_module, "FastPathSetup", receiver_breaks_once)
    impl = memory_transport(MemoryFabric())

    async def scenario() -> None:
        got: list[ReceivedTransfer] = []
        listener, link = await open_pair(impl, impl, pki, got)
        try:
            assert broken and link.fast_path.name == "tcp"
            assert "RDMA set-up failed: AttributeError" in link.fast_path.reason
            await transfer_whole(listener, link, got, 1 << 20)
        finally:
            await link.close()
            await listener.close()

    run_async(scenario, 60.0)
