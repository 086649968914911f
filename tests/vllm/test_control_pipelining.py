"""The connector's control client against a real sidecar control server (a Unix socket, an asyncio
loop in a thread): pipelined ``send`` answers come back in order, a ``call`` reads what is still
owed first, refusals raise when read, and a closed channel fails what it still owed."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pddlink.errors import InvalidInput, RemoteError, Unavailable
from sidecar.vllm_kv.control import ControlClient, Op, serve_control


@pytest.fixture
def server() -> Iterator[tuple[Path, list[str]]]:
    seen: list[str] = []

    def handler(op: Op, msg: dict[str, Any]) -> dict[str, Any]:
        seen.append(f"{op.value}:{msg.get('transfer')}")
        if msg.get("transfer") == "bad":
            raise InvalidInput("no such transfer")
        return {"echo": msg.get("transfer"), "n": len(seen)}

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    path = Path(tempfile.mkdtemp(prefix="pddlink-ctl-")) / "c.sock"
    srv = asyncio.run_coroutine_threadsafe(serve_control(path, handler), loop).result(5)
    try:
        yield path, seen
    finally:

        async def stop() -> None:
            srv.close()
            await srv.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        path.unlink(missing_ok=True)
        path.parent.rmdir()


def test_sent_requests_are_answered_in_order_and_a_call_reads_what_is_owed(server) -> None:
    path, seen = server
    client = ControlClient(path)
    try:
        a = client.send(Op.ALLOC, transfer="t1")
        b = client.send(Op.COMMIT, transfer="t1")
        assert client.call(Op.STATUS, transfer="s")["echo"] == "s"  # read a's and b's answers first
        assert a.done and b.done
        assert a.result()["n"] == 1 and b.result()["n"] == 2
        c = client.send(Op.ALLOC, transfer="t2")
        assert c.result()["echo"] == "t2"  # read on demand
        assert seen == ["alloc:t1", "commit:t1", "status:s", "alloc:t2"]
    finally:
        client.close()


def test_a_refused_request_raises_when_its_answer_is_read(server) -> None:
    path, _ = server
    client = ControlClient(path)
    try:
        bad = client.send(Op.COMMIT, transfer="bad")
        good = client.send(Op.ALLOC, transfer="ok")
        assert good.result()["echo"] == "ok"
        with pytest.raises(RemoteError, match="no such transfer"):
            bad.result()
        with pytest.raises(RemoteError):
            client.call(Op.COMMIT, transfer="bad")
    finally:
        client.close()


def test_owed_answers_fail_when_the_channel_goes() -> None:
    path = Path(tempfile.mkdtemp(prefix="pddlink-ctl-")) / "none.sock"
    client = ControlClient(path, timeout_s=1.0)
    lost = client.send(Op.ALLOC, transfer="t")  # nobody listens: the send fails, typed
    with pytest.raises(Unavailable):
        lost.result()
    client.close()
    path.parent.rmdir()


def test_close_fails_what_is_still_owed(server) -> None:
    path, _ = server
    client = ControlClient(path)
    owed = client.send(Op.ALLOC, transfer="t")
    client.close()
    with pytest.raises(Unavailable):
        owed.result()
