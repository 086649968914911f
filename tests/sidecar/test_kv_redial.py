"""P's KV link to MD re-dials a link that is closed or gave up reconnecting (issue 16, chaos: after
MD restarts or a long WAN outage P answered ``md_unreachable: cancelled: link closed``).

Against a real MD sidecar process: a ``KVPeer`` reserves, MD is killed (SIGKILL, for real) and
restarted on the same KV port; once the old link has given up reopening its connections, the next
use dials a new link and the reservation succeeds. And a late failure on an old client never
closes the link that replaced it (the cascade that kept a pool of links closing each other)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pddlink.errors import DeadlineExceeded, ErrorCode, LocalError, Unavailable
from pddlink.transport import LinkOptions, PeerIdentity
from pddlink.wire import KVLayoutSpec, Reserve, ReserveAnswer, TransferBegin
from sidecar.peers import KVPeer, redial_after
from tests.sidecar.test_bounded_state import start_md

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
OPTIONS = LinkOptions(reconnect_attempts=2, reconnect_backoff_s=0.05)
LAYOUT = KVLayoutSpec("torch_ref/tiny", 2, 2, 32, "float64", 16)


def kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(15)


async def send(peer: KVPeer) -> None:
    client = await peer.client(time.monotonic() + 10.0)
    data = os.urandom(4096)
    begin = TransferBegin(7, 0, "orphan", LAYOUT, 0, 16, (1,), 0, len(data), 4096, 10_000)
    result = await client.send_transfer(begin, data, deadline_s=10.0)
    assert result.bytes == len(data)


async def reserve(peer: KVPeer, rid: str) -> ReserveAnswer:
    client = await peer.client(time.monotonic() + 10.0)
    answer = await client.request(Reserve(rid, (1, 2, 3), 500), timeout_s=5.0)
    assert isinstance(answer, ReserveAnswer) and answer.code is None, answer
    return answer


def test_a_link_to_a_restarted_md_is_dialled_again(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, ready, _ = start_md(tmp_path / "a")
    procs = [first]
    port = ready["kv_port"]

    async def run() -> None:
        peer = KVPeer(
            f"127.0.0.1:{port}", identity=PeerIdentity("p", "p0"), tls=None, transport="tcp",
            options=OPTIONS,
        )  # fmt: skip
        await reserve(peer, "before")
        old = await peer.client(time.monotonic() + 5.0)
        kill(procs[0])  # kill -9: its sockets reset, the link's reconnects find nothing listening
        end = time.monotonic() + 10.0
        while old.usable and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert not old.usable, "the old link never reported that it gave up"
        proc, ready, _ = await asyncio.to_thread(start_md, tmp_path / "b", "--kv-port", str(port))
        procs.append(proc)
        assert ready["kv_port"] == port
        await reserve(peer, "after")
        new = await peer.client(time.monotonic() + 5.0)
        assert new is not old and new.usable and peer.redials == 1
        await send(peer)  # the new link's stripes carry a transfer
        await peer.drop()

    try:
        asyncio.run(run())
    finally:
        for proc in procs:
            kill(proc)


def test_a_late_failure_on_an_old_client_keeps_the_new_link(tmp_path: Path) -> None:
    proc, ready, _ = start_md(tmp_path)
    peer = KVPeer(
        f"127.0.0.1:{ready['kv_port']}", identity=PeerIdentity("p", "p0"), tls=None, transport="tcp",
        options=OPTIONS,
    )  # fmt: skip

    async def run() -> None:
        old = await peer.client(time.monotonic() + 5.0)
        await peer.drop(old)  # a transfer on it failed: the next use dials anew
        new = await peer.client(time.monotonic() + 5.0)
        assert new is not old
        await peer.drop(old)  # a second transfer that had the old client fails late
        assert await peer.client(time.monotonic() + 5.0) is new and new.usable
        await reserve(peer, "kept")
        await peer.drop()

    try:
        asyncio.run(run())
    finally:
        kill(proc)


def test_only_a_lost_given_up_or_stalled_link_is_closed_after_a_failed_transfer(tmp_path: Path) -> None:
    """A transfer that missed its deadline on a link that answers leaves the link to the others
    on it (closing it cancelled them all: ``md_unreachable: cancelled: link closed`` in chaos)."""
    proc, ready, _ = start_md(tmp_path)
    peer = KVPeer(
        f"127.0.0.1:{ready['kv_port']}", identity=PeerIdentity("p", "p0"), tls=None, transport="tcp",
        options=OPTIONS,
    )  # fmt: skip

    async def run() -> None:
        client = await peer.client(time.monotonic() + 5.0)
        heard = client.stats().bytes_received
        late = DeadlineExceeded("transfer missed its deadline")
        assert redial_after(late, client, heard)  # nothing came back: stalled
        await reserve(peer, "answers")  # the link answers: bytes came back since
        assert not redial_after(late, client, heard)
        assert not redial_after(LocalError("link closed", code=ErrorCode.CANCELLED), client, heard)
        assert redial_after(Unavailable("reset", code=ErrorCode.PEER_UNREACHABLE), client, heard)
        await send(peer)
        assert await peer.client(time.monotonic() + 5.0) is client
        await peer.drop()
        assert redial_after(LocalError("link closed", code=ErrorCode.CANCELLED), client, heard)  # closed

    try:
        asyncio.run(run())
    finally:
        kill(proc)
