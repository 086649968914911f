"""The connector's control client against a real sidecar control server (a Unix socket, an asyncio
loop in a thread): pipelined ``send`` answers come back in order, a ``call`` reads what is still
owed first, refusals raise when read, and a closed channel fails what it still owed. The
connector's ``SidecarChannel`` over it: an unawaited request's refusal is logged at the channel's
next use, and ``call_or_warn`` logs a refusal instead of raising."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines_adapter.vllm.sidecar_channel import SidecarChannel
from pddlink.connector.control import ControlClient, Op, serve_control
from pddlink.errors import InvalidInput, RemoteError, Unavailable


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


def test_an_unawaited_refusal_is_logged_at_the_channels_next_use(server, caplog) -> None:
    path, seen = server
    channel = SidecarChannel(path)
    caplog.set_level(logging.WARNING, logger="pddlink.vllm")
    try:
        channel.send_unawaited(Op.RELEASE, transfer="bad", reason="request finished")
        channel.call(Op.STATUS, transfer="s")  # its answer is read here, but not looked at
        assert "release of bad failed" not in caplog.text
        channel.send_unawaited(Op.RELEASE, transfer="ok", reason="loaded")
        assert "pddlink sidecar release of bad failed" in caplog.text
        assert "no such transfer" in caplog.text
        channel.call(Op.STATUS, transfer="end")  # the sidecar has handled everything sent before
        assert seen == ["release:bad", "status:s", "release:ok", "status:end"]
    finally:
        channel.close()


def test_call_or_warn_logs_a_refusal_instead_of_raising(server, caplog) -> None:
    path, _ = server
    channel = SidecarChannel(path)
    caplog.set_level(logging.WARNING, logger="pddlink.vllm")
    try:
        assert channel.call_or_warn(Op.RELEASE, transfer="bad", reason="save failed: x") is None
        assert "pddlink sidecar release failed" in caplog.text
        answer = channel.call_or_warn(Op.RELEASE, transfer="ok", reason="commit failed: x")
        assert answer is not None and answer["echo"] == "ok"
    finally:
        channel.close()
