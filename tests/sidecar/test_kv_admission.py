"""RelayDecode refuses at Attach, at once and typed, what its KV pool cannot hold (issue 16: at 50
concurrent requests RLD's pool ran out, ``KV pool has N blocks to give``, and requests failed late).

The booking rules in memory, then a real RLD sidecar process with a 10-block pool: one Attach that
can need 8 blocks is admitted (and waits for its KV); a second one is refused with
``RESOURCE_EXHAUSTED`` ``capacity: ...`` within a second, not at its deadline; once the first
stream ends, its blocks are free again."""

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

import grpc
import pytest

from pddlink.serving.grpc_tls import open_channel
from pddlink.serving.rpc import stubs
from pddlink.wire import WIRE_VERSION
from router.role_health import FULL_COOL_S, RoleHealth
from sidecar.kv_admission import CapacityRefused, KvAdmission

pytestmark = pytest.mark.timeout(120)
PB2, PB2_GRPC = stubs()


def test_bookings_are_worst_case_blocks_and_end_with_their_release() -> None:
    gate = KvAdmission(10, 16)
    a = gate.admit("a", 100, 20)  # 120 tokens: 8 blocks
    assert a.blocks == 8 and gate.booked_blocks == 8
    with pytest.raises(CapacityRefused, match="capacity: the request can need 3 KV blocks, 2 of 10"):
        gate.admit("b", 40, 1)
    with pytest.raises(CapacityRefused, match="already attached"):
        gate.admit("a", 1, 1)
    gate.admit("c", 20, 12)  # 2 blocks: fits exactly
    gate.release(a)
    gate.release(a)  # twice: no effect
    assert gate.booked_blocks == 2 and gate.refused == 1
    capped = KvAdmission(100, 16, max_requests=1)
    capped.admit("x", 1, 1)
    with pytest.raises(CapacityRefused, match="the cap is 1"):
        capped.admit("y", 1, 1)


@pytest.fixture
def rld_port(tmp_path: Path) -> Iterator[int]:
    """A real RLD sidecar process with a 10-block KV pool (plaintext, loopback)."""
    argv = [sys.executable, "-m", "pddlink.cli.main", "sidecar", "--role", "rld", "--num-blocks", "10"]
    argv += ["--md-grpc", "127.0.0.1:9", "--admin-unix", str(tmp_path / "rld.sock"), "--tls-dir", ""]
    log = open(tmp_path / "rld.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY "), (tmp_path / "rld.log").read_text()
        yield int(json.loads(line[6:])["grpc_port"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        log.close()


def attach(stub: Any, rid: str, tokens: int, deadline_s: float) -> Any:
    return stub.Attach(
        PB2.AttachRequest(
            request_id=rid,
            prompt=list(range(1, tokens + 1)),
            sampling=PB2.Sampling(max_tokens=20),
            deadline_s=deadline_s,
            wire_version=WIRE_VERSION,
        ),
        timeout=deadline_s + 5.0,
    )


@pytest.mark.e2e
def test_rld_refuses_an_attach_its_pool_cannot_hold_at_once(rld_port: int) -> None:
    async def run() -> tuple[grpc.StatusCode, str, float, grpc.StatusCode | None]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rld_port}") as ch:
            stub = PB2_GRPC.SidecarStub(ch)
            first = attach(stub, "first", 100, 3.0)  # 8 of 10 blocks, waits for KV
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            try:
                async for _ in attach(stub, "second", 100, 20.0):
                    pass
                raise AssertionError("the second Attach was admitted")
            except grpc.aio.AioRpcError as exc:
                code, details, took = exc.code(), exc.details() or "", time.monotonic() - t0
            async for _ in first:
                pass  # ends at its deadline: no KV came
            again: grpc.StatusCode | None = None
            try:
                async for _ in attach(stub, "third", 100, 0.5):
                    pass
            except grpc.aio.AioRpcError as exc:
                again = exc.code()
            return code, details, took, again

    code, details, took, again = asyncio.run(run())
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("capacity:"), details
    assert took < 2.0, f"refused after {took:.1f} s"
    assert again is None  # the first's blocks were released: admitted, ended at its deadline


@pytest.mark.e2e
def test_the_routers_view_marks_a_refusing_rld_full_before_the_caller_sees_the_error(rld_port: int) -> None:
    """What the router's fallback reads (``rld_usable``) already says no when the refusal arrives."""
    health = RoleHealth(("rld",))

    async def run() -> tuple[bool, bool, bool]:
        ch = open_channel(f"127.0.0.1:{rld_port}", None, None, interceptors=health.interceptors("rld"))
        try:
            stub = PB2_GRPC.SidecarStub(ch)
            first = attach(stub, "first", 100, 3.0)
            reader = asyncio.ensure_future(first.__aiter__().__anext__())
            await asyncio.sleep(0.5)
            before = health.usable("rld")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in attach(stub, "second", 100, 20.0):
                    pass
            at_refusal = health.usable("rld")
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            reader.cancel()  # the caller gives up the first stream: the RPC ends, its blocks free
            await asyncio.sleep(FULL_COOL_S + 0.2)
            async for _ in attach(stub, "third", 100, 0.3):
                pass  # admitted: the first's booking was released by the cancel
            return before, at_refusal, health.usable("rld")
        finally:
            await ch.close(None)

    before, at_refusal, later = asyncio.run(run())
    assert before and not at_refusal and later
    assert health.status()["rld"]["capacity_refusals"] == 1
