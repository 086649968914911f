"""Large request bodies parsed and tokenized in worker processes (issue 27), so the router's event
loop never waits on them: pydantic's JSON parse and the byte checks hold the GIL, so on the
router's threads one client's large bodies held every other client's requests (four ~1 MB bodies at
once: the loop's longest stall 7-14 ms; in worker processes 1 ms, on 2 busy cores).

Lifecycle: ``ParsePool(n, limits, codec, eos)`` names the pool (no process yet); ``start()`` spawns
its ``n`` workers (``spawn``, not ``fork``: the router has gRPC's threads), each of which unpickles
the tokenizer once and runs only on CPU time nothing else wants, and sets ``ready``; ``wake()``
starts them in the background (the router does at its first large body, which, like every body
until ``ready``, is parsed on its threads: a router that never sees one never spawns a process,
and none waits 2-5 s of imports); ``job(body, endpoint)``
answers the validated ``Job`` or raises the schema's ``RequestRefused``, as
``router.openai_job.completion_job`` does in the router; ``close()`` lets the workers finish
what they hold and exit.

A body the HTTP server left on the socket (``pddlink.serving.http_lent``: over 64 kB, plaintext)
is received by the worker itself, from a duplicate of the client's socket (``lent``): its bytes
never pass through the router's event loop, which only hands over the socket and the few bytes that
came with the head. Without that, receiving four concurrent 1 MB bodies and passing them to the
workers cost another client's small request 1.57-1.72x its first-token time. A client slower than
``GIVE_BACK_S`` gets its body received by the router as before: the worker gives back what it has.
The socket travels as multiprocessing passes sockets (``multiprocessing.resource_sharer``: a
duplicate sent over a unix socket to the worker that unpickles it). A worker that received part of
a body and then died leaves the client's connection unusable: it is closed (``BodyState.LOST``).
If a worker dies after its socket was pickled and before it took it, the duplicate stays with the
sharer: one descriptor in the router per such death (the connection itself is shut down).

A worker sends back only what the loop needs: the ``Job`` (token ids, sampling) or a ``Refused``
(message, field), never an exception object (``RequestRefused``'s field would not survive
pickling). A worker that dies takes the pool's requests with it: each gets ``ParserLost``
(503, send it again), the pool is replaced at once, and the next request is parsed by the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from pddlink.errors import ErrorCode, InvalidInput, LocalError
from pddlink.serving.http_lent import LentBody
from router.openai_job import Job, completion_job
from router.openai_schema import Endpoint, Limits, RequestRefused
from router.openai_text import TextCodec

PROCESS_BYTES = 64 << 10  # a body this large is parsed in a worker process (smaller: on the router's threads)
# how long a worker receives a lent body before it gives back what it has (a slow client's body
# is then received by the router's loop, where slowness costs nothing): a slow client cannot hold
# a worker, nor, with two, every request's large body behind it
GIVE_BACK_S = 0.5


class ParserLost(LocalError):
    """The worker process parsing a request died (killed, out of memory): the request was not run."""

    code = ErrorCode.UNAVAILABLE


class BodyNotReceived(LocalError):
    """A lent body's bytes did not all arrive: past its deadline, or the client left."""

    code = ErrorCode.DEADLINE_EXCEEDED


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
    """A worker's answer for a body the schema refuses: ``RequestRefused``'s message and field."""

    message: str
    param: str = ""


@dataclass(frozen=True, slots=True)
class _Schema:
    """What a worker parses with: sent to each worker once, when it starts."""

    limits: Limits
    codec: TextCodec | None
    eos: int | None


_schema: _Schema | None = None  # a worker's, set by ``_start_worker``


def _start_worker(schema: _Schema) -> None:
    global _schema
    _schema = schema
    _yield_cpu()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C stops the router, which stops us
    parent = multiprocessing.parent_process()
    if parent is not None:  # a router killed outright (SIGKILL) leaves no worker behind
        threading.Thread(target=_exit_with, args=(parent,), name="parent-watch", daemon=True).start()


def _yield_cpu() -> None:
    """Run only on CPU time nothing else wants (Linux ``SCHED_IDLE``; a nice of 19 elsewhere): the
    scheduler gives the CPU to a waking router or sidecar at once, where a nice of 10 leaves a
    parse running to the end of its slice. ``pddlink bench edge``'s load on 2 shared cores does not
    resolve the difference (the small request's loaded first token with four 1 MB bodies parsed,
    minus with them read and not parsed: -0.8 and +5.6 ms in two runs; nice 10: +2.0 ms). Under a
    saturated CPU a parse still advances, slowly: only its own request waits."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread and those it starts
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 19)


def _exit_with(parent: BaseProcess) -> None:
    parent.join()  # returns when the parent process has ended
    os._exit(1)


def _ready() -> None:
    pass


def _parse(body: bytes, endpoint: Endpoint) -> Job | Refused:
    assert _schema is not None, "not a ParsePool worker"
    try:
        return completion_job(body, endpoint, _schema.limits, _schema.codec, _schema.eos)
    except InvalidInput as exc:
        return Refused(exc.message, getattr(exc, "param", "") or "")


def receive(
    sock: socket.socket | None, first: bytes, rest: int, deadline: float, give_back_s: float = math.inf
) -> bytes | Partial | Lost:
    """``first`` and then exactly ``rest`` more bytes from ``sock`` by ``deadline`` (monotonic: one
    clock for every process of the machine), or what arrived within ``give_back_s`` of the start
    when the client is slower than that (``Partial``: the router reads the rest itself, so a slow
    client holds a worker no longer). The socket is non-blocking (it is the router's): only
    timeouts here, never ``setblocking(True)``."""
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


def _receive_parse(
    sock: socket.socket | None,
    first: bytes,
    rest: int,
    deadline: float,
    give_back_s: float,
    endpoint: Endpoint,
) -> Job | Refused | Lost | Partial:
    try:
        body = receive(sock, first, rest, deadline, give_back_s)
    finally:
        if sock is not None:
            sock.close()  # this process's duplicate only: the connection stays the router's
    return _parse(body, endpoint) if isinstance(body, bytes) else body


class ParsePool:
    """``workers`` processes that turn request bodies into jobs (``completion_job``)."""

    def __init__(self, workers: int, limits: Limits, codec: TextCodec | None, eos: int | None) -> None:
        self.workers = workers
        self.give_back_s = GIVE_BACK_S
        self.schema = _Schema(limits, codec, eos)
        self.pool = self._new_pool()
        self.restart: asyncio.Task[None] | None = None  # the workers spawning (woken or replaced)
        self.ready = False  # a worker of the current pool has answered

    def _new_pool(self) -> ProcessPoolExecutor:
        ctx = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(self.workers, ctx, initializer=_start_worker, initargs=(self.schema,))

    async def start(self) -> None:
        """Spawn every worker now, not at the first large body: the pool spawns one for each call
        submitted while none is idle. Returns once a worker answers (the others may be loading)."""
        pool = self.pool
        await asyncio.gather(*(asyncio.wrap_future(pool.submit(_ready)) for _ in range(self.workers)))
        self.ready = self.pool is pool

    def wake(self) -> None:
        """Start the workers in the background, once (``ready`` when they answer)."""
        if self.restart is None and not self.ready:
            self.restart = asyncio.get_running_loop().create_task(self._start_quietly())

    async def job(self, body: bytes, endpoint: Endpoint) -> Job:
        """The validated job; ``RequestRefused`` (400) or ``ParserLost`` (503) else."""
        pool = self.pool
        try:
            got = await asyncio.wrap_future(pool.submit(_parse, body, endpoint))
        except BrokenProcessPool:
            self._replace(pool)
            raise ParserLost("the process parsing this request stopped; send it again") from None
        if isinstance(got, Refused):
            raise RequestRefused(got.message, got.param)
        return got

    async def job_lent(self, lent: LentBody, endpoint: Endpoint) -> Job | None:
        """``job`` for a body still on the client's socket, received by the worker (``receive``);
        None when its client sent too slowly and the worker gave back what it received (in
        ``lent``: the caller reads the rest); ``BodyNotReceived`` when it did not arrive whole by
        its deadline. ``lent`` is told how it went."""
        pool = self.pool
        sock = lent.lend()
        got: Job | Refused | Lost | Partial = Lost("the worker did not answer")
        try:
            call = pool.submit(
                _receive_parse, sock, lent.first, lent.rest, lent.deadline, self.give_back_s, endpoint
            )
            got = await asyncio.wrap_future(call)
        except BrokenProcessPool:
            self._replace(pool)
            raise ParserLost("the process parsing this request stopped; send it again") from None
        finally:
            if isinstance(got, Partial):
                lent.given_back(got.received)
            else:
                lent.returned(not isinstance(got, Lost))
            if sock is not None:
                sock.close()  # the worker received its own duplicate (or never will: the pool is gone)
        if isinstance(got, Partial):
            return None
        if isinstance(got, Lost):
            raise BodyNotReceived(got.why)
        if isinstance(got, Refused):
            raise RequestRefused(got.message, got.param)
        return got

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """A new pool for a broken one (once, however many of its requests notice), its workers
        spawning in the background: the requests that noticed are answered at once."""
        if self.pool is not broken:
            return
        broken.shutdown(wait=False, cancel_futures=True)
        self.pool = self._new_pool()
        self.ready = False
        self.restart = asyncio.get_running_loop().create_task(self._start_quietly())

    async def _start_quietly(self) -> None:
        with contextlib.suppress(BrokenProcessPool, RuntimeError):  # broken again, or closed
            await self.start()

    def close(self) -> None:
        if self.restart is not None:
            self.restart.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
