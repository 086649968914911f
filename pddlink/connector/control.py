"""The control channel between vLLM's connector and its sidecar: JSON lines over a Unix socket.

Only control crosses it (transfer ids, slot offsets, states); KV bytes stay in the shared-memory
region (``pddlink.connector.shm``). One request line, one answer line: ``{"op": ..., ...}`` ->
``{"ok": true, ...}`` or ``{"ok": false, "error": "code: text"}``. The connector's side is a
blocking client (vLLM's scheduler and worker call it from their own threads, a round trip is tens
of microseconds); the sidecar's side is an asyncio server whose handler answers at once (anything
slow, like a WAN transfer, runs as a task the handler only starts). Answers come back in request
order on each connection, not across connections: vLLM's scheduler and worker each hold one of
their own, so the sidecar makes an ALLOC wait for its PREPARE. The client can also pipeline:
``send`` writes a request and returns a ``Pending`` whose answer is read later (the connector
sends P's ALLOC before vLLM's forward and reads it after, and does not wait for COMMIT's,
PREPARE's or RELEASE's answer), or by the next ``call``, which reads every answer still owed;
``poll_answers`` reads those already arrived without blocking.

Operations (who sends them):
  PREPARE  P scheduler: a request will produce KV for ``transfer`` (``prompt`` token ids); the
           sidecar starts its reservation at MD now, while vLLM prefills.
  ALLOC    P worker: a slot of ``nbytes`` -> ``offset`` and ``first_block`` (MD's reserved prefix
           when already known, else 0: copy everything, the sidecar ships only what MD lacks).
  COMMIT   P worker: the slot holds blocks ``first_block``.. of ``num_blocks``; ship them.
  POLL     MD worker: states of ``transfers`` (pending / landed with its slot / failed with reason).
  RELEASE  either side: the transfer is done with (loaded, aborted, finished): free what it holds.
  STATUS   anyone: region and transfer counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from pddlink.errors import ErrorCode, InvalidInput, PddlinkError, RemoteError, Unavailable

MAX_LINE = 1 << 20


class Op(StrEnum):
    PREPARE = "prepare"
    ALLOC = "alloc"
    COMMIT = "commit"
    POLL = "poll"
    RELEASE = "release"
    STATUS = "status"


class TransferState(StrEnum):
    PENDING = "pending"
    LANDED = "landed"
    FAILED = "failed"


# an answer now, or one that comes once something the request depends on has happened (P's ALLOC
# on the worker's channel waits for the PREPARE that the scheduler's channel carries)
Handler = Callable[[Op, dict[str, Any]], dict[str, Any] | Awaitable[dict[str, Any]]]


def field(msg: dict[str, Any], name: str, kind: type) -> Any:
    """A typed field of a control message, or InvalidInput naming it."""
    value = msg.get(name)
    if kind is int and isinstance(value, bool):
        value = None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind):
        raise InvalidInput(f"control message field {name!r} must be {kind.__name__}, got {value!r}")
    return value


async def _answer(handler: Handler, line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise InvalidInput("a control message is a JSON object")
        op = Op(str(msg.get("op")))
        out = handler(op, msg)
        if not isinstance(out, dict):
            out = await out
        return {"ok": True, **out}
    except PddlinkError as exc:
        return {"ok": False, "error": f"{exc.code.name.lower()}: {exc.message}"}
    except (ValueError, KeyError, TypeError) as exc:
        return {"ok": False, "error": f"bad_request: {exc}"}


class ConnectionWatch(Protocol):
    """Told of each control connection's life: who is at the other end (the engine's process,
    ``peer_pid``) and when it goes (the sidecar notices its engine's death by them)."""

    def opened(self, conn: int, pid: int | None) -> None: ...

    def closed(self, conn: int) -> None: ...


def peer_pid(sock: Any) -> int | None:
    """The process at the other end of a Unix socket (SO_PEERCRED); None where the kernel cannot
    say (another PID namespace reads 0, or no such option)."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return None
    return pid or None


async def serve_control(
    path: Path, handler: Handler, *, watch: ConnectionWatch | None = None
) -> asyncio.AbstractServer:
    """Serve the channel on ``path`` (replaced if it exists, mode 0600); ``watch`` hears each
    connection open (with its peer's pid) and close."""
    path.unlink(missing_ok=True)
    conns = iter(range(1, 1 << 62))

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = next(conns)
        if watch is not None:
            watch.opened(conn, peer_pid(writer.get_extra_info("socket")))
        try:
            while line := await reader.readline():
                writer.write(json.dumps(await _answer(handler, line)).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            if watch is not None:
                watch.closed(conn)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_unix_server(on_client, path=str(path), limit=MAX_LINE)
    path.chmod(0o600)
    return server


class Pending:
    """An answer owed by the sidecar for a request ``ControlClient.send`` wrote."""

    def __init__(self, client: ControlClient, op: Op) -> None:
        self._client, self.op = client, op
        self._answer: dict[str, Any] | None = None
        self._error: PddlinkError | None = None

    @property
    def done(self) -> bool:
        return self._answer is not None or self._error is not None

    def _set(self, answer: dict[str, Any] | None, error: PddlinkError | None = None) -> None:
        self._answer, self._error = answer, error

    def result(self) -> dict[str, Any]:
        """The answer (blocking until it is read); raises as ``ControlClient.call`` does."""
        if not self.done:
            with self._client._lock:
                self._client._drain(until=self)
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return _checked(self.op, self._answer)


def _checked(op: Op, answer: dict[str, Any]) -> dict[str, Any]:
    if not answer.get("ok"):
        raise RemoteError(f"sidecar refused {op.value}: {answer.get('error')}")
    return dict(answer)


class ControlClient:
    """The connector's side: one blocking connection, reopened once after a failure."""

    def __init__(self, path: Path, *, timeout_s: float = 5.0) -> None:
        self.path, self.timeout_s = path, timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()  # bytes read past the last whole answer line
        self._lock = threading.Lock()
        self._owed: list[Pending] = []  # answers not read yet, in request order

    def send(self, op: Op, **fields: Any) -> Pending:
        """Write a request without waiting for its answer (read it with ``Pending.result``)."""
        line = json.dumps({"op": op.value, **fields}).encode() + b"\n"
        pending = Pending(self, op)
        with self._lock:
            try:
                if self._sock is None:
                    self._open()
                assert self._sock is not None
                self._sock.sendall(line)
            except OSError as exc:
                self._fail_owed(exc)
                self._close()
                pending._set(None, self._unavailable(exc))
                return pending
            self._owed.append(pending)
        return pending

    def _readline(self, *, block: bool = True) -> bytes | None:
        """One answer line; None when ``block`` is False and no whole line has arrived yet."""
        assert self._sock is not None
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > MAX_LINE:
                raise ConnectionError(f"control answer longer than {MAX_LINE} bytes")
            if not block and not select.select([self._sock], [], [], 0)[0]:
                return None
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("sidecar closed the control channel")
            self._buf += chunk
        line = bytes(self._buf[: end + 1])
        del self._buf[: end + 1]
        return line

    def _drain(self, until: Pending | None = None, *, block: bool = True) -> None:
        """Read owed answers in order (all of them, or up to ``until``; with ``block`` False only
        those already arrived); under ``_lock``."""
        while self._owed:
            pending = self._owed[0]
            try:
                reply = self._readline(block=block)
            except OSError as exc:
                self._fail_owed(exc)
                self._close()
                return
            if reply is None:
                return
            self._owed.pop(0)
            pending._set(json.loads(reply))
            if pending is until:
                return

    def poll_answers(self) -> None:
        """Read the owed answers that have already arrived, without waiting for any."""
        with self._lock:
            if self._owed:
                self._drain(block=False)

    def _fail_owed(self, exc: OSError) -> None:
        for pending in self._owed:
            pending._set(None, self._unavailable(exc))
        self._owed.clear()

    def _unavailable(self, exc: OSError) -> Unavailable:
        return Unavailable(f"sidecar control channel {self.path}: {exc}", code=ErrorCode.PEER_UNREACHABLE)

    def call(self, op: Op, **fields: Any) -> dict[str, Any]:
        line = json.dumps({"op": op.value, **fields}).encode() + b"\n"
        with self._lock:
            self._drain()
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._open()
                    assert self._sock is not None
                    self._sock.sendall(line)
                    reply = self._readline()
                    break
                except OSError as exc:
                    self._close()
                    if attempt:
                        raise self._unavailable(exc) from exc
        assert reply is not None  # a blocking read returns a line or raises
        return _checked(op, json.loads(reply))

    def _open(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        self._sock, self._buf = sock, bytearray()

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock, self._buf = None, bytearray()

    def close(self) -> None:
        with self._lock:
            self._fail_owed(ConnectionError("control client closed"))
            self._close()
