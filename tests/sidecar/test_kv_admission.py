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
from pathlib import Path

import grpc
import pytest

from sidecar.kv_admission import CapacityRefused, KvAdmission
from sidecar.rpc import stubs

pytestmark = pytest.mark.timeout(120)


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


@pytest.mark.e2e
def test_rld_refuses_an_attach_its_pool_cannot_hold_at_once(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pddlink.cli.main", "sidecar", "--role", "rld", "--num-blocks", "10"]
    argv += ["--md-grpc", "127.0.0.1:9", "--admin-unix", str(tmp_path / "rld.sock"), "--tls-dir", ""]
    log = open(tmp_path / "rld.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY "), (tmp_path / "rld.log").read_text()
        port = json.loads(line[6:])["grpc_port"]
        pb2, pb2_grpc = stubs()

        def attach(stub: object, rid: str, tokens: int, deadline_s: float) -> object:
            return stub.Attach(  # type: ignore[attr-defined]
                pb2.AttachRequest(
                    request_id=rid,
                    prompt=list(range(1, tokens + 1)),
                    sampling=pb2.Sampling(max_tokens=20),
                    deadline_s=deadline_s,
                ),
                timeout=deadline_s + 5.0,
            )

        async def run() -> tuple[grpc.StatusCode, str, float, grpc.StatusCode | None]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb2_grpc.SidecarStub(ch)
                first = attach(stub, "first", 100, 3.0)  # 8 of 10 blocks, waits for KV
                await asyncio.sleep(0.5)
                t0 = time.monotonic()
                try:
                    async for _ in attach(stub, "second", 100, 20.0):  # type: ignore[attr-defined]
                        pass
                    raise AssertionError("the second Attach was admitted")
                except grpc.aio.AioRpcError as exc:
                    code, details, took = exc.code(), exc.details() or "", time.monotonic() - t0
                async for _ in first:  # type: ignore[attr-defined]
                    pass  # ends at its deadline: no KV came
                again: grpc.StatusCode | None = None
                try:
                    async for _ in attach(stub, "third", 100, 0.5):  # type: ignore[attr-defined]
                        pass
                except grpc.aio.AioRpcError as exc:
                    again = exc.code()
                return code, details, took, again

        code, details, took, again = asyncio.run(run())
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("capacity:"), details
        assert took < 2.0, f"refused after {took:.1f} s"
        assert again is None  # the first's blocks were released: admitted, ended at its deadline
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        log.close()
