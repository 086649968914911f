"""The parse worker process (``router.parse_pool``'s side of it): one job at a time, read from a
unix socket it shares with the router, its answer written back on the same socket.

Wire: each message is a 4-byte big-endian length and a pickle. The router's messages are
``ParseTask`` or ``LentTask``; a ``LentTask`` carries the client's socket as a descriptor
(``SCM_RIGHTS``) on its length bytes, so handing a connection over is one ``sendmsg``: no thread in
the router, no listener, no handshake (``multiprocessing``'s ``resource_sharer`` had all three on
the router's GIL, per body). The worker's first message is ``READY`` (its tokenizer loaded), then
one answer per task: a ``Job``, ``Refused``, ``Lost``, ``Partial`` or ``Failed``. A worker exits
when the router's end closes (the router stopped, or died: a SIGKILLed router leaves no worker).
A descriptor in flight to a worker that died is freed by the kernel with the socket.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import socket
import time
from dataclasses import dataclass

from pddlink.errors import InvalidInput
from pddlink.serving.malloc_trim import keep_heap
from router.openai_job import Job, completion_job
from router.openai_schema import Endpoint, Limits
from router.openai_text import TextCodec

READY = "ready"
LENGTH_BYTES = 4


@dataclass(frozen=True, slots=True)
class Schema:
    """What a worker parses with: given to each worker once, when it starts."""

    limits: Limits
    codec: TextCodec | None
    eos: int | None


@dataclass(frozen=True, slots=True)
class ParseTask:
    """Parse ``body`` (received by the router)."""

    body: bytes
    endpoint: Endpoint


@dataclass(frozen=True, slots=True)
class LentTask:
    """Receive the body's ``rest`` from the socket sent with this task (``first`` came with the
    head), by ``deadline`` (monotonic: one clock for every process of the machine), and parse it."""

    first: bytes
    rest: int
    deadline: float
    give_back_s: float
    endpoint: Endpoint


@dataclass(frozen=True, slots=True)
class Lost:
    """A worker's answer for a lent body it could not receive whole."""

    why: str


@dataclass(frozen=True, slots=True)
class Partial:
    """A worker's answer for a lent body whose client sent too slowly: the bytes it received."""

    received: bytes


@dataclass(frozen=True, slots=True)
class Refused:
    """A worker's answer for a body the schema refuses: ``RequestRefused``'s message and field
    (never the exception itself: its field would not survive pickling)."""

    message: str
    param: str = ""


@dataclass(frozen=True, slots=True)
class Failed:
    """A worker's answer when parsing raised what the schema does not (a defect): its text."""

    error: str


Answer = Job | Refused | Lost | Partial | Failed


def serve(conn: socket.socket, schema: Schema) -> None:
    """The worker's main: ``READY``, then a task and its answer at a time until the router's end
    closes."""
    _yield_cpu()
    keep_heap()  # each body's buffers reuse the last one's pages
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C stops the router, which stops us
    with contextlib.suppress(OSError):
        send_message(conn, READY)
        while True:
            try:
                task, fds = recv_message(conn)
            except EOFError:
                return
            client = socket.socket(fileno=fds[0]) if fds else None
            for extra in fds[1:]:
                os.close(extra)
            send_message(conn, answer(task, client, schema))


def answer(task: object, client: socket.socket | None, schema: Schema) -> Answer:
    try:
        if isinstance(task, ParseTask):
            return _parse(task.body, task.endpoint, schema)
        if isinstance(task, LentTask):
            try:
                body = receive(client, task.first, task.rest, task.deadline, task.give_back_s)
            finally:
                if client is not None:
                    client.close()  # this process's descriptor only: the connection stays the router's
            return _parse(body, task.endpoint, schema) if isinstance(body, bytes) else body
        return Failed(f"not a task: {type(task).__name__}")
    except Exception as exc:  # a defect is answered, not a dead worker
        return Failed(f"{type(exc).__name__}: {exc}")


def _parse(body: bytes, endpoint: Endpoint, schema: Schema) -> Job | Refused:
    try:
        return completion_job(body, endpoint, schema.limits, schema.codec, schema.eos)
    except InvalidInput as exc:
        return Refused(exc.message, getattr(exc, "param", "") or "")


def receive(
    sock: socket.socket | None, first: bytes, rest: int, deadline: float, give_back_s: float = math.inf
) -> bytes | Partial | Lost:
    """``first`` and then exactly ``rest`` more bytes from ``sock`` by ``deadline`` (monotonic),
    or what arrived within ``give_back_s`` of the start when the client is slower than that
    (``Partial``: the router reads the rest itself, so a slow client holds a worker no longer). The
    socket is non-blocking (it is the router's): only timeouts here, never ``setblocking(True)``."""
    buf = bytearray(len(first) + rest)
    buf[: len(first)] = first
    view, got = memoryview(buf), len(first)
    give_back = min(deadline, time.monotonic() + give_back_s)
    while got < len(buf):
        assert sock is not None
        sock.settimeout(max(0.0, give_back - time.monotonic()))  # 0: one try that does not wait
        try:
            n = sock.recv_into(view[got:])
        except (TimeoutError, BlockingIOError):
            break
        except OSError as exc:
            return Lost(f"the client left mid-body: {exc}")
        if not n:
            return Lost("the client left mid-body")
        got += n
    view.release()
    if got == len(buf):
        return bytes(buf)
    if time.monotonic() >= deadline:
        return Lost("request body not received in time")
    return Partial(bytes(buf[:got]))


def send_message(conn: socket.socket, message: object) -> None:
    """One message on a blocking socket (the worker's side)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(len(payload).to_bytes(LENGTH_BYTES, "big") + payload)


def recv_message(conn: socket.socket) -> tuple[object, list[int]]:
    """One message and the descriptors sent with it, from a blocking socket (``EOFError``: the
    router's end closed). The router sends a task's descriptor with its length bytes and never a
    second task before the answer, and each receive here asks for no more than the current
    message's bytes: so the descriptors that arrive with a length are that message's."""
    head, fds = b"", []
    while len(head) < LENGTH_BYTES:
        data, got, _, _ = socket.recv_fds(conn, LENGTH_BYTES - len(head), 4)
        fds += got
        if not data:
            raise EOFError
        head += data
    buf = bytearray(int.from_bytes(head, "big"))
    view, n = memoryview(buf), 0
    while n < len(buf):
        k = conn.recv_into(view[n:])
        if not k:
            raise EOFError
        n += k
    return pickle.loads(buf), fds


def _yield_cpu() -> None:
    """Run only on CPU time nothing else wants (Linux ``SCHED_IDLE``; a nice of 19 elsewhere): the
    scheduler gives the CPU to a waking router or sidecar at once, where a nice of 10 leaves a
    parse running to the end of its slice. Under a saturated CPU a parse still advances, slowly:
    only its own request waits."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 19)
