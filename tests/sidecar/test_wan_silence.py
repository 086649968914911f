"""P's WAN link to MD notices silence (``sidecar.wan_silence``): what waits on it ends once nothing
has come back for the bound, not at its deadline (issue 16, chaos: shipments to MD in flight when
a long WAN outage began waited out 6 s of their 10 s deadline, and the fallback to RelayDecode then
had too little time left).

The silent peer is a real MD sidecar process stopped with SIGSTOP: its kernel still takes the
bytes, but nothing answers, as when a WAN black-holes the packets coming back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines_adapter import SamplingParams
from pddlink.errors import ErrorCode, PddlinkError, Unavailable
from pddlink.handoff import HandoffMode, HandoffSlice
from pddlink.serving.handoff_wire import slice_to_wire
from pddlink.transport import LinkOptions, PeerIdentity
from pddlink.wire import Reserve, ReserveAnswer, TransferBegin
from sidecar.peers import DecoderPeer, KVPeer
from sidecar.wan_silence import SILENCE_MIN_S, CallSilence, Silence, silence_bound
from tests.sidecar.test_bounded_state import start_md
from tests.sidecar.test_kv_redial import LAYOUT, kill

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
OPTIONS = LinkOptions(reconnect_attempts=2, reconnect_backoff_s=0.05)


def test_the_bound_follows_the_rtt_above_a_floor() -> None:
    assert silence_bound(None) == SILENCE_MIN_S
    assert silence_bound(0.02) == SILENCE_MIN_S  # 8 RTTs of 20 ms: the floor
    assert silence_bound(0.5) == pytest.approx(4.0)  # a long, queued path gets 8 RTTs
    assert silence_bound(0.001, floor_s=0.2) == 0.2


def test_silence_counts_from_the_later_of_the_wait_and_the_last_byte_heard() -> None:
    s = Silence()
    assert s.silent_for(10.0, since=9.0) == 1.0  # never heard: since the wait began
    s.observe(5.0, client_id=1, bytes_received=100)
    s.observe(8.0, client_id=1, bytes_received=100)  # nothing new: still heard at 5
    assert s.silent_for(10.0, since=4.0) == 5.0
    s.observe(9.0, client_id=1, bytes_received=130)
    assert s.silent_for(10.0, since=4.0) == 1.0
    s.observe(9.5, client_id=2, bytes_received=0)  # a new client: its handshake was heard
    assert s.silent_for(10.0, since=4.0) == 0.5


def _peer(port: int, floor_s: float | None) -> KVPeer:
    return KVPeer(
        f"127.0.0.1:{port}", identity=PeerIdentity("p", "p0"), tls=None, transport="tcp",
        options=OPTIONS, silence_floor_s=floor_s,
    )  # fmt: skip


async def _reserve(peer: KVPeer, rid: str, deadline_s: float) -> ReserveAnswer:
    answer = await peer.request(Reserve(rid, (1, 2, 3), 500), time.monotonic() + deadline_s)
    assert isinstance(answer, ReserveAnswer) and answer.code is None, answer
    return answer


@contextlib.contextmanager
def _stopped(proc: subprocess.Popen[str]) -> Iterator[None]:
    """MD (and its engine) stopped for real: its kernel takes the bytes, nothing answers."""
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def test_a_silent_md_ends_reservations_and_transfers_at_the_bound_then_the_link_recovers(
    tmp_path: Path,
) -> None:
    proc, ready, _ = start_md(tmp_path)
    peer = _peer(ready["kv_port"], SILENCE_MIN_S)

    async def run() -> None:
        await _reserve(peer, "live", 5.0)
        with _stopped(proc):
            t0 = time.monotonic()
            with pytest.raises(Unavailable) as err:
                await _reserve(peer, "silent", 10.0)
            took = time.monotonic() - t0
            assert err.value.code is ErrorCode.PEER_UNREACHABLE and "silent" in str(err.value)
            assert SILENCE_MIN_S * 0.9 <= took < SILENCE_MIN_S + 1.5, took  # not its 10 s deadline
            data = os.urandom(1 << 20)
            begin = TransferBegin(9, 0, "silent-kv", LAYOUT, 0, 16, (1,), 0, len(data), 1 << 16, 10_000)
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                await peer.send(begin, memoryview(data), time.monotonic() + 10.0)
            assert time.monotonic() - t0 < SILENCE_MIN_S + 1.5
            assert peer.silence is not None and peer.silence.silenced == 2
        await _reserve(peer, "back", 5.0)  # MD answers again: the link is dialled anew and serves
        await peer.drop()

    try:
        asyncio.run(run())
    finally:
        kill(proc)


def test_without_the_watch_a_silent_md_holds_the_reservation_to_its_deadline(tmp_path: Path) -> None:
    """What the watch replaces (and what a link to RelayDecode still does): the wait ends only at
    the deadline."""
    proc, ready, _ = start_md(tmp_path)
    peer = _peer(ready["kv_port"], None)

    async def run() -> None:
        await _reserve(peer, "live", 5.0)
        with _stopped(proc):
            t0 = time.monotonic()
            with pytest.raises(PddlinkError) as err:
                await _reserve(peer, "silent", 3.0)
            assert err.value.code is ErrorCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 >= 2.9
        await peer.drop()

    try:
        asyncio.run(run())
    finally:
        kill(proc)


def _handoff_frame(rid: str) -> bytes:
    s = HandoffSlice(rid, 8, (5, 6), True, HandoffMode.ONE_SHOT)
    return slice_to_wire(s, SamplingParams(max_tokens=4))


def test_a_handoff_to_a_silent_md_ends_at_the_bound_and_an_answering_one_is_waited_for(
    tmp_path: Path,
) -> None:
    """RLD's token-id handoff (gRPC) to a stopped MD: ``Unavailable`` once its pings have gone
    unanswered for the bound, not at the call's 10 s timeout; before and after, MD's own answer
    (it holds no such request) comes back as MD's error."""
    proc, ready, _ = start_md(tmp_path)

    async def answered(peer: DecoderPeer, rid: str) -> PddlinkError:
        with pytest.raises(PddlinkError) as err:
            await peer.handoff(_handoff_frame(rid), timeout_s=10.0)
        assert "the WAN is silent" not in str(err.value), err.value  # MD's own answer
        return err.value

    async def run() -> None:
        addr, md0 = f"127.0.0.1:{ready['grpc_port']}", PeerIdentity("md", "md0")
        peer = DecoderPeer(addr, tls=None, expected=md0, silence_floor_s=SILENCE_MIN_S)
        await answered(peer, "before")
        assert peer.silence is not None
        with _stopped(proc):
            t0 = time.monotonic()
            with pytest.raises(Unavailable) as err:
                await peer.handoff(_handoff_frame("silent"), timeout_s=10.0)
            took = time.monotonic() - t0
            assert err.value.code is ErrorCode.PEER_UNREACHABLE and "silent" in str(err.value)
            assert SILENCE_MIN_S * 0.9 <= took < SILENCE_MIN_S + 1.5, took
            assert peer.silence.silenced == 1
            # without a floor (RLD, beside its sender) the call waits for its own timeout
            local = DecoderPeer(addr, tls=None, expected=md0)
            t0 = time.monotonic()
            with pytest.raises(PddlinkError) as err:
                await local.handoff(_handoff_frame("local"), timeout_s=2.5)
            assert err.value.code is ErrorCode.DEADLINE_EXCEEDED and time.monotonic() - t0 >= 2.4
            await local.close()
        await answered(peer, "after")
        await peer.close()

    try:
        asyncio.run(run())
    finally:
        kill(proc)


def test_a_slow_call_to_a_peer_that_answers_its_pings_is_not_cut() -> None:
    """``CallSilence`` against a peer whose pings come back (a busy MD): a call three bounds long
    ends with its own result."""

    async def ping(timeout_s: float) -> None:
        await asyncio.sleep(0.01)

    async def slow() -> str:
        await asyncio.sleep(3 * 0.2)
        return "done"

    async def run() -> None:
        guard = CallSilence("peer", ping, floor_s=0.2)
        assert await guard.guard("slow", slow()) == "done"
        assert guard.silenced == 0 and guard.rtt_s is not None

    asyncio.run(run())
