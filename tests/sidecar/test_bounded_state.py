"""Bounded sidecar state (issue 16, item 6): every entry a sidecar keeps ends by its deadline, and a
dead engine child takes the sidecar out of the pool.

The sweep's decisions are checked as a table (``verdict``); then against a real MD sidecar process:
a KV transfer that no Attach ever claims and a DRC reservation that P never commits are both held
(``/status`` ``state.held``), then dropped to 0 by the sweep; and an MD whose engine process is
killed (SIGKILL, for real) answers ``/healthz`` 503 and exits with one error line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pddlink.serving.http import fetch
from pddlink.transport import KVClient, PeerIdentity
from pddlink.wire import WIRE_VERSION, KVLayoutSpec, Reserve, ReserveAnswer, TransferBegin
from sidecar.sweep import HeldEntry, SweepPolicy, Verdict, verdict

pytestmark = pytest.mark.timeout(120)
POLICY = SweepPolicy(interval_s=1.0, grace_s=1.0, orphan_s=5.0)


def entry(
    deadline: float = 100.0, *, attached: bool = True, ended: bool = False, before: bool = False
) -> HeldEntry:
    return HeldEntry("r", deadline, attached, ended, before)


@pytest.mark.parametrize(
    ("e", "now", "unattached_for", "expected"),
    [
        (entry(), 50.0, 0.0, Verdict.KEEP),  # attached, before its deadline
        (entry(), 100.5, 0.0, Verdict.KEEP),  # within the grace: its own stream ends it
        (entry(), 101.5, 0.0, Verdict.END),  # past deadline + grace, still open
        (entry(ended=True), 101.5, 0.0, Verdict.FORGET),  # ended, nobody took it away
        (entry(ended=True), 50.0, 0.0, Verdict.KEEP),  # ended, its stream may still drain it
        (entry(attached=False), 50.0, 4.9, Verdict.KEEP),  # KV before Attach: a moment is normal
        (entry(attached=False), 50.0, 5.0, Verdict.END),  # the Attach is not coming
        (entry(attached=False, before=True), 50.0, 0.0, Verdict.END),  # late KV of an ended request
        (entry(attached=False, ended=True, before=True), 50.0, 0.0, Verdict.FORGET),
    ],
)
def test_sweep_verdicts(e: HeldEntry, now: float, unattached_for: float, expected: Verdict) -> None:
    assert verdict(e, now, unattached_for, POLICY) is expected


def status(admin: str) -> dict[str, Any]:
    code, body = fetch("unix:" + admin, "GET", "/status", timeout_s=5.0)
    assert code == 200, body
    doc: dict[str, Any] = json.loads(body)
    return doc


def start_md(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, Any], str]:
    admin = str(tmp_path / "md.admin.sock")
    argv = [sys.executable, "-m", "pddlink.cli.main", "sidecar", "--role", "md", "--num-blocks", "256"]
    argv += ["--admin-unix", admin, *extra]
    log = open(tmp_path / "md.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY "), (tmp_path / "md.log").read_text()
    return proc, json.loads(line[6:]), admin


@pytest.fixture
def md(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any], str]]:
    proc, ready, admin = start_md(tmp_path)
    try:
        yield proc, ready, admin
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)


def wait_for(pred: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.25)
    return False


def test_orphan_kv_and_an_uncommitted_reservation_are_dropped_by_their_deadlines(
    md: tuple[subprocess.Popen[str], dict[str, Any], str],
) -> None:
    proc, ready, admin = md
    layout = KVLayoutSpec("torch_ref/tiny", 2, 2, 32, "float64", 16)
    hashes = tuple(range(1, 5))

    async def ship() -> Any:
        client = await KVClient.connect(
            "127.0.0.1", ready["kv_port"], identity=PeerIdentity("p", "p0"), tls=None
        )
        try:
            answer = await client.request(Reserve("kept", hashes, 2000), timeout_s=10.0)
            data = os.urandom(4096)
            begin = TransferBegin(7, 0, "orphan", layout, 0, 16, hashes[:1], 0, len(data), 4096, 10_000)
            await client.send_transfer(begin, data, deadline_s=10.0)
            return answer
        finally:
            await client.close()

    answer = asyncio.run(ship())
    assert isinstance(answer, ReserveAnswer) and answer.code is None
    held = status(admin)["state"]["held"]
    # both are held right after (the orphan's Attach could still come; the lease runs 2 s)
    assert held["waiting_kv"] == 1 and held["requests"] == 1, held
    assert wait_for(lambda: status(admin)["state"]["held"]["reservations"] == 0, 6.0)
    assert wait_for(
        lambda: status(admin)["state"]["held"] == {"requests": 0, "waiting_kv": 0, "reservations": 0}, 12.0
    )
    state = status(admin)["state"]
    assert state["swept"]["ended"] >= 1 and state["swept"]["leases"] >= 1, state
    _, text = fetch("unix:" + admin, "GET", "/metrics")
    assert 'pddlink_sidecar_held{kind="waiting_kv"} 0.0' in text.decode()
    assert proc.poll() is None


def engine_child(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert children, "the sidecar has no engine child"
    return int(children[0])


def test_a_dead_engine_child_makes_the_sidecar_unhealthy_and_leave(tmp_path: Path) -> None:
    proc, _, admin = start_md(tmp_path, "--engine-mode", "process")
    try:
        assert fetch("unix:" + admin, "GET", "/healthz")[0] == 200
        os.kill(engine_child(proc.pid), signal.SIGKILL)
        codes: list[int] = []

        def unhealthy() -> bool:
            try:
                codes.append(fetch("unix:" + admin, "GET", "/healthz", timeout_s=2.0)[0])
            except OSError:  # the sidecar is gone: the socket refuses
                return proc.poll() is not None
            return codes[-1] == 503

        assert wait_for(unhealthy, 10.0), codes
        assert 200 not in codes[1:] or codes[-1] == 503
        proc.wait(15)
        assert proc.returncode == 2
        last = (tmp_path / "md.log").read_text().strip().splitlines()[-1]
        assert last.startswith("error: sidecar md/md0 stopped: the engine process is gone"), last
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_reservation_for_a_request_that_already_ended_is_released_at_once(
    md: tuple[subprocess.Popen[str], dict[str, Any], str],
) -> None:
    """A Reserve that reaches MD after its request ended there (late on the WAN, or its transfer
    never came) pins blocks for its whole lease unless the sweep releases it."""
    import grpc

    from pddlink.serving.rpc import stubs

    _, ready, admin = md
    pb2, pb2_grpc = stubs()

    async def scenario() -> list[Any]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as channel:
            stub = pb2_grpc.SidecarStub(channel)
            req = pb2.AttachRequest(
                request_id="gone", prompt=list(range(1, 40)), deadline_s=0.3, wire_version=WIRE_VERSION
            )
            req.sampling.max_tokens = 4
            events = [ev async for ev in stub.Attach(req, timeout=10.0)]  # no KV: its deadline ends it
        client = await KVClient.connect(
            "127.0.0.1", ready["kv_port"], identity=PeerIdentity("p", "p0"), tls=None
        )
        try:
            await client.request(Reserve("gone", (11, 12, 13), 60_000), timeout_s=10.0)  # a 60 s lease
        finally:
            await client.close()
        return events

    events = asyncio.run(scenario())
    assert events and events[-1].closed == pb2.STREAM_END_FAILED and events[-1].reason == "deadline_exceeded"
    t0 = time.monotonic()
    assert wait_for(lambda: status(admin)["state"]["held"]["reservations"] == 0, 10.0)
    assert time.monotonic() - t0 < 10.0 and status(admin)["state"]["swept"]["leases_of_ended"] == 1
