"""An ended transfer lets go of its payload at once, without the cyclic GC (issue 16).

A sidecar's KV payload (1-2 MiB a request) is freed when the last reference to it goes. A transfer
driver that sits in a reference cycle keeps it until the GC's next full collection, which a quiet
process may never run: a P held ~90 ended transfers' KV (230 MiB) after its warm-up that way, and
more after a burst, through the driver <-> timer cycle (completed transfers) and through a failed
transfer's error kept in the driver's future with a traceback back to the sender's frames. With
the GC off, a ``bytearray`` payload can be resized again only once no view of it is left."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from pddlink.errors import ErrorCode, PddlinkError
from tests.transport.test_tcp_link import begin, start_pair


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def views_left(payload: bytearray) -> bool:
    try:
        payload.extend(b"x")
    except BufferError:  # "Existing exports of data: object cannot be re-sized"
        return True
    del payload[-1:]
    return False


def test_a_completed_transfer_keeps_no_view_of_its_payload(pki: Any, run_async: Any, no_gc: None) -> None:
    payload = bytearray(3 << 20)

    async def scenario() -> bool:
        server, client = await start_pair(pki, 2)
        try:
            await client.send_transfer(begin(1, len(payload)), payload, deadline_s=10.0)
            return views_left(payload)
        finally:
            await client.close()
            await server.close()

    assert run_async(scenario) is False


def test_a_failed_transfer_keeps_no_view_of_its_payload(pki: Any, run_async: Any, no_gc: None) -> None:
    payload = bytearray(64 << 20)  # far more than ends within its 1 ms deadline

    async def send(client: Any) -> ErrorCode:
        try:
            await client.send_transfer(begin(1, len(payload)), payload, deadline_s=0.001)
        except PddlinkError as exc:
            return exc.code
        raise AssertionError("a 64 MiB transfer ended within 1 ms")

    async def scenario() -> tuple[ErrorCode, bool]:
        server, client = await start_pair(pki, 2)
        try:
            code = await send(client)
            return code, views_left(payload)
        finally:
            await client.close()
            await server.close()

    code, left = run_async(scenario)
    assert code is ErrorCode.DEADLINE_EXCEEDED
    assert left is False
