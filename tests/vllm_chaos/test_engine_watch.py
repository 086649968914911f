"""A sidecar notices its vLLM's death and resets what it held for it.

In memory: ``EngineWatch``'s table (a watched process's exit, the last unwatched connection, a
second signal of the same death, a new engine back), the KV-event feed's sequence (a new publisher
clears the DRC; the dead one's queued batches are ignored). Then a real sidecar (``VllmSidecar``, MD
role, in this process) with a real child process on its control channel in vLLM's place: the child
is killed -9 while the sidecar holds a landed transfer, a reservation and DRC blocks for it; the
sidecar holds none of them once the kernel has reaped the child's socket, and a new child is
served."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engines_adapter.vllm.engine_watch import EngineBack, EngineLost, EngineState, EngineWatch
from pddlink.connector.kv_events import STALE_S, KvEventFeed
from pddlink.drc import PrefixIndex
from pddlink.roles import Role


def test_a_watched_process_exit_is_the_engine_lost_once_and_a_new_one_comes_back() -> None:
    w = EngineWatch()
    assert w.connected(1, 100, 0.0) == [] and w.connected(2, 100, 0.1) == []
    assert w.state is EngineState.UP and w.pids == {100}
    assert w.closed(1, 0.2) == []  # a watched peer's connection closing is not its death
    lost = w.exited(100, 0.3)
    assert lost == [EngineLost("the engine's process 100 exited", 0.3)] and w.state is EngineState.LOST
    assert w.closed(2, 0.3) == [] and w.exited(100, 0.4) == []  # the same death, seen again
    assert w.connected(3, 100, 0.5) == []  # a late connection of the dead process
    assert w.state is EngineState.LOST
    assert w.connected(4, 200, 9.0) == [EngineBack(200, 9.0)] and w.state is EngineState.UP
    assert w.losses == 1 and w.status()["pids"] == [200]


def test_the_exit_counts_when_the_kernel_closed_the_connections_first() -> None:
    w = EngineWatch()
    w.connected(1, 100, 0.0)
    w.connected(2, 100, 0.0)
    assert w.closed(1, 1.0) == [] and w.closed(2, 1.0) == []  # a killed process: sockets go first
    assert w.state is EngineState.UP
    assert w.exited(100, 1.01) == [EngineLost("the engine's process 100 exited", 1.01)]


def test_unwatched_peers_are_lost_with_their_last_connection_and_strangers_exit_quietly() -> None:
    w = EngineWatch()
    assert w.exited(7, 0.0) == []  # nothing seen yet: no engine to lose
    w.connected(1, None, 0.0)
    w.connected(2, None, 0.0)
    assert w.closed(1, 1.0) == []
    assert w.closed(2, 2.0) == [EngineLost("the engine's control connections closed", 2.0)]
    assert w.closed(2, 2.0) == []
    w.connected(3, 300, 3.0)
    assert w.exited(999, 3.5) == []  # some other process
    assert w.state is EngineState.UP


def _stored(h: int, parent: int | None, tokens: list[int]) -> object:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_feed_clears_for_a_new_publisher_and_ignores_the_dead_ones_queue() -> None:
    import pytest

    pytest.importorskip("vllm", reason="vLLM is not installed here")
    index = PrefixIndex(None)
    feed = KvEventFeed(index, model_id="m", block_size=4)
    for seq in range(3):
        assert feed.accept(seq, 1.0)
        feed.apply([_stored(seq + 1, seq or None, [seq] * 4)])
    assert len(index) == 3
    feed.engine_lost(10.0)
    assert len(index) == 0
    assert not feed.accept(3, 10.5)  # queued before the kill: the dead engine's
    assert feed.accept(0, 10.0 + STALE_S + 30)  # the new engine's publisher starts over
    feed.apply([_stored(50, None, [9] * 4)])
    assert len(index) == 1 and feed.counts["restarts"] == 1 and feed.counts["stale"] == 1
    assert feed.accept(1, 50.0) and feed.counts["gaps"] == 0
    assert feed.accept(0, 60.0) and len(index) == 0  # started over again, without a word before


CHILD = """
import sys, time
from pddlink.connector.control import ControlClient, Op
c = ControlClient(__import__("pathlib").Path(sys.argv[1]))
c.call(Op.STATUS)
c.call(Op.POLL, transfers=["t1"])
print("up", flush=True)
time.sleep(600)
"""


def _child(sock: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(sock)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    return proc


async def _wait_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return await asyncio.to_thread(proc.stdout.readline)


def test_sidecar_resets_what_it_held_when_its_engine_is_killed() -> None:
    from pddlink.transport import PeerIdentity
    from pddlink.wire import Reserve
    from sidecar.vllm_kv.service import VllmSidecar, VllmSidecarConfig

    work = Path(tempfile.mkdtemp(prefix="pddlink-ew-"))
    cfg = VllmSidecarConfig(
        role=Role.MD, name="md0", workdir=work, model_id="m", block_size=4, region_bytes=8 << 20
    )

    async def go() -> dict[str, object]:
        side = await VllmSidecar(cfg).start()
        try:
            child = _child(side.control_path)
            assert (await _wait_line(child)).strip() == "up"
            c = side.consumer
            assert c is not None
            # what a request of this engine leaves: a reservation (DRC pin), DRC blocks, a slot
            c.index.insert([11, 12, 13], time.monotonic())
            peer = PeerIdentity("p", "p0")
            answer = c.on_message(peer, Reserve(request_id="t1", block_hashes=(11, 12, 99), lease_ms=30000))
            assert answer.cached_blocks == 2
            e = c._entry("t1")
            e.slot = c.region.alloc(4096)
            before = side.status()
            os.kill(child.pid, signal.SIGKILL)
            end = time.monotonic() + 5
            while side.status()["in_flight"] and time.monotonic() < end:
                await asyncio.sleep(0.05)
            after = side.status()
            child.wait(5)
            fresh = _child(side.control_path)
            assert (await _wait_line(fresh)).strip() == "up"
            back = side.status()
            fresh.kill()
            fresh.wait(5)
            return {"before": before, "after": after, "back": back, "leases": c.index.stats().reservations}
        finally:
            await side.close()

    r = asyncio.run(go())
    before, after, back = r["before"], r["after"], r["back"]
    assert isinstance(before, dict) and isinstance(after, dict) and isinstance(back, dict)
    assert before["in_flight"] == 1 and before["held_slots"] == 1 and before["drc_blocks"] == 3
    assert before["engine"]["state"] == "up"
    assert (after["in_flight"], after["held_slots"], after["held_bytes"], after["drc_blocks"]) == (0, 0, 0, 0)
    assert after["engine"]["state"] == "lost" and after["engine_lost_released"] == 1
    assert back["engine"]["state"] == "up" and back["engine"]["losses"] == 1
    assert r["leases"] == 0
