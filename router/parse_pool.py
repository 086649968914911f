"""Large request bodies parsed and tokenized in worker processes (issue 27), so the router's event
loop never waits on them: pydantic's JSON parse and the byte checks hold the GIL, so on the
router's threads one client's large bodies held every other client's requests (four ~1 MB bodies at
once: the loop's longest stall 7-14 ms; in worker processes 1 ms, on 2 busy cores).

Lifecycle: ``ParsePool(n, limits, codec, eos)`` names the pool (no process yet); ``start()`` spawns
its ``n`` workers (``spawn``, not ``fork``: the router has gRPC's threads; ``router.parse_worker``),
each of which unpickles the tokenizer once, runs only on CPU time nothing else wants, and says it
is ready; ``ready`` while one is; ``wake()`` starts them in the background (the router does at its
first large body, which, like every body until ``ready``, is parsed on its threads: a router that
never sees one never spawns a process, and none waits 2-5 s of imports); ``job(body, endpoint)``
answers the validated ``Job`` or raises the schema's ``RequestRefused``, as
``router.openai_job.completion_job`` does in the router; ``close()`` ends the idle workers and
drops the busy ones' answers (their tasks get ``ParserLost``; each exits once its task is done).

Each worker is one process and one unix socket to it, and holds one task at a time: a task waits
for an idle worker here, in arrival order, for as long as it takes (a parse is bounded by its
body's deadline, a tokenizing by the request's size). The loop only sends, and reads the answer when the
socket says it is there; nothing else runs in the router for a worker (no thread).

A body the HTTP server left on the socket (``pddlink.serving.http_lent``: over 64 kB, plaintext)
is received by the worker itself (``job_lent``): the client's socket goes to the worker as a
descriptor with the task, and the body's bytes never pass through the router. A client slower than
``GIVE_BACK_S`` gets its body received by the router as before: the worker gives back what it has.
A worker that received part of a body and then died leaves the client's connection unusable: it is
closed (``BodyState.LOST``).

A worker that dies takes its task with it: that request gets ``ParserLost`` (503, send it again)
and the worker is replaced in the background (one that fails to start is tried again every
``RESPAWN_S``); an idle worker's death is seen at once (its socket
reads end of file) and a task never goes to a worker known dead. With every worker gone,
``ready`` is false and bodies are parsed on the router's threads until a replacement answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import pickle
import socket
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from pddlink.errors import ErrorCode, LocalError
from pddlink.serving.http_lent import LentBody
from router.openai_job import Job
from router.openai_schema import Endpoint, Limits, RequestRefused
from router.openai_text import TextCodec
from router.parse_worker import (
    LENGTH_BYTES,
    READY,
    Answer,
    Failed,
    LentTask,
    Lost,
    ParseTask,
    Partial,
    Refused,
    Schema,
    serve,
)

log = logging.getLogger(__name__)

PROCESS_BYTES = 64 << 10  # a body this large is parsed in a worker process (smaller: on the router's threads)
# how long a worker receives a lent body before it gives back what it has (a slow client's body
# is then received by the router's loop, where slowness costs nothing): a slow client cannot hold
# a worker, nor, with two, every request's large body behind it
GIVE_BACK_S = 0.5
READY_S = 120.0  # a worker that has not loaded its tokenizer by then is killed
RESPAWN_S = 5.0  # a worker that failed to start is tried again after this


class ParserLost(LocalError):
    """The worker process parsing a request died (killed, out of memory): the request was not run."""

    code = ErrorCode.UNAVAILABLE


class NoParser(ParserLost):
    """No worker is up to take the task (every one died since ``ready`` was read): nothing of the
    request was sent to a worker, so the caller parses it itself, as before the workers ran."""


class BodyNotReceived(LocalError):
    """A lent body's bytes did not all arrive: past its deadline, or the client left."""

    code = ErrorCode.DEADLINE_EXCEEDED


class _Gone(Exception):
    """A worker's socket ended: the worker died (or was killed)."""


@dataclass(eq=False)
class _Worker:
    proc: BaseProcess
    conn: socket.socket  # the router's end: non-blocking
    head: bytearray = field(default_factory=lambda: bytearray(LENGTH_BYTES))

    async def send(self, message: object, fd: int | None = None) -> None:
        """``message``, with ``fd`` (the client's socket) on its length bytes."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        length = len(payload).to_bytes(LENGTH_BYTES, "big")
        loop = asyncio.get_running_loop()
        sent = await _send_fd(loop, self.conn, length, fd) if fd is not None else 0
        await loop.sock_sendall(self.conn, length[sent:] + payload)

    async def answer(self) -> object:
        await self._exactly(self.head)
        buf = bytearray(int.from_bytes(self.head, "big"))
        await self._exactly(buf)
        return pickle.loads(buf)

    async def _exactly(self, buf: bytearray) -> None:
        loop, view, got = asyncio.get_running_loop(), memoryview(buf), 0
        while got < len(buf):
            n = await loop.sock_recv_into(self.conn, view[got:])
            if not n:
                raise _Gone
            got += n

    def end(self) -> None:
        self.conn.close()
        with contextlib.suppress(OSError, ValueError, AttributeError):  # AttributeError: not started yet
            self.proc.kill()


async def _send_fd(loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes, fd: int) -> int:
    """Send a first part of ``data`` with ``fd`` (one ``sendmsg``); the bytes it took."""
    while True:
        try:
            return socket.send_fds(conn, [data], [fd])
        except BlockingIOError:  # the worker's socket buffer is full (it holds no task: rare)
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(conn.fileno(), _settle, writable)
            try:
                await writable
            finally:
                loop.remove_writer(conn.fileno())


class ParsePool:
    """``workers`` processes that turn request bodies into jobs (``completion_job``)."""

    def __init__(self, workers: int, limits: Limits, codec: TextCodec | None, eos: int | None) -> None:
        self.workers = workers
        self.give_back_s = GIVE_BACK_S
        self.schema = Schema(limits, codec, eos)
        self.live: set[_Worker] = set()  # ready and not known dead
        self.idle: list[_Worker] = []
        self.waiting: collections.deque[asyncio.Future[_Worker]] = collections.deque()
        self.spawning: set[asyncio.Task[None]] = set()
        self.starting: set[_Worker] = set()  # spawned, not ready yet
        self.waking: asyncio.Task[None] | None = None  # ``wake``'s start
        self.closed = False
        self.retry: asyncio.TimerHandle | None = None  # a failed spawn tried again
        self.loop: asyncio.AbstractEventLoop  # the router's, where idle workers are watched

    @property
    def ready(self) -> bool:
        """A worker is up (tasks go to the pool, not to the router's threads)."""
        return bool(self.live)

    async def start(self) -> None:
        """Spawn every worker not yet running or spawning; returns once each has answered or
        failed (raising the first failure when no worker is up)."""
        for _ in range(self.workers - len(self.live) - len(self.spawning)):
            self._spawn()
        failed = await asyncio.gather(*self.spawning, return_exceptions=True)
        errors = [e for e in failed if isinstance(e, BaseException)]
        if errors and not self.live:
            raise errors[0]

    def wake(self) -> None:
        """Start the workers in the background, once (``ready`` when one answers)."""
        if self.waking is None and not self.ready:
            self.waking = asyncio.get_running_loop().create_task(self.start())

    async def job(self, body: bytes, endpoint: Endpoint) -> Job:
        """The validated job; ``RequestRefused`` (400) or ``ParserLost`` (503) else (``NoParser``:
        no worker took it, parse it elsewhere)."""
        got = await self._run(ParseTask(body, endpoint))
        return _job(got)

    async def job_lent(self, lent: LentBody, endpoint: Endpoint) -> Job | None:
        """``job`` for a body still on the client's socket, received by the worker (its
        ``receive``); None when its client sent too slowly and the worker gave back what it
        received (in ``lent``: the caller reads the rest); ``BodyNotReceived`` when it did not
        arrive whole by its deadline. ``lent`` is told how it went."""
        task = LentTask(lent.first, lent.rest, lent.deadline, self.give_back_s, endpoint)
        try:
            got = await self._run(task, lent)
        except NoParser:
            raise  # no worker took the socket: the body is whole on it, still ``lent``'s to read
        except BaseException:
            lent.returned(False)
            raise
        if isinstance(got, Partial):
            lent.given_back(got.received)
            return None
        lent.returned(isinstance(got, Job | Refused))  # whole only when parsed: ``Failed`` may be mid-body
        if isinstance(got, Lost):
            raise BodyNotReceived(got.why)
        return _job(got)

    async def _run(self, task: ParseTask | LentTask, lent: LentBody | None = None) -> Answer:
        """``task`` on the next idle worker; the client's socket from ``lent`` goes with it. The
        exchange runs to its answer even when the caller is cancelled, so that the worker's next
        task starts on a clean socket."""
        while True:
            worker = await self._take()
            sock = None
            try:
                sock = lent.lend() if lent is not None else None
            except BaseException:
                self._give(worker)
                raise
            exchange = asyncio.ensure_future(self._exchange(worker, task, sock))
            exchange.add_done_callback(_retrieved)  # a caller cancelled meanwhile never reads it
            got = await asyncio.shield(exchange)
            if got is not None:
                return got
            # None: the worker was dead before it took the task; the next one gets it

    async def _exchange(self, worker: _Worker, task: object, sock: socket.socket | None) -> Answer | None:
        try:
            try:
                await worker.send(task, None if sock is None else sock.fileno())
            finally:
                if sock is not None:
                    sock.close()  # in flight, the descriptor is the kernel's until the worker takes it
        except OSError:
            self._lost(worker)
            return None
        try:
            got = await worker.answer()
        except Exception:  # the socket ended or the answer is garbled: the stream is no longer usable
            self._lost(worker)
            raise ParserLost("the process parsing this request stopped; send it again") from None
        self._give(worker)
        return got  # type: ignore[return-value]

    async def _take(self) -> _Worker:
        if self.idle:
            worker = self.idle.pop()
            self.loop.remove_reader(worker.conn.fileno())
            return worker
        if not self.live:
            raise NoParser("no process is parsing requests")
        waiter: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give(waiter.result())  # handed over just as the caller gave up
            raise

    def _give(self, worker: _Worker) -> None:
        """``worker`` is idle: to the first task waiting, or watched until one comes (an idle
        worker sends nothing: its socket becoming readable is its end)."""
        if worker not in self.live:
            return
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self.idle.append(worker)
        self.loop.add_reader(worker.conn.fileno(), self._idle_ended, worker)

    def _idle_ended(self, worker: _Worker) -> None:
        self.loop.remove_reader(worker.conn.fileno())
        self.idle.remove(worker)
        self._lost(worker)

    def _lost(self, worker: _Worker) -> None:
        """``worker`` is dead: the tasks waiting get ``ParserLost`` if none is left, and a new
        worker spawns in the background."""
        if worker not in self.live:
            return
        self.live.discard(worker)
        worker.end()
        _reap_later(worker.proc)
        if not self.live:
            while self.waiting:
                waiter = self.waiting.popleft()
                if not waiter.done():
                    waiter.set_exception(NoParser("the processes parsing requests stopped"))
        if not self.closed:
            self._spawn()

    def _spawn(self) -> None:
        self.loop = asyncio.get_running_loop()  # every worker's first: none is idle before it spawned
        task = self.loop.create_task(self._spawn_one())
        self.spawning.add(task)
        task.add_done_callback(self._spawned)

    def _spawned(self, task: asyncio.Task[None]) -> None:
        self.spawning.discard(task)
        if not task.cancelled() and task.exception() is not None and not self.closed:
            log.warning("a parse worker did not start (again in %.0f s): %r", RESPAWN_S, task.exception())
            self.retry = asyncio.get_running_loop().call_later(RESPAWN_S, self._respawn)

    def _respawn(self) -> None:
        if not self.closed and len(self.live) + len(self.spawning) < self.workers:
            self._spawn()

    async def _spawn_one(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=serve, args=(theirs, self.schema), name="pddlink-parse", daemon=True)
        worker = _Worker(proc, ours)
        self.starting.add(worker)
        # the start writes the pickled tokenizer to the child: on a thread, not the loop; shielded,
        # so that a cancelled spawn still knows the start is over before it ends what started
        started = asyncio.ensure_future(asyncio.to_thread(proc.start))
        try:
            try:
                await asyncio.shield(started)
            finally:
                with contextlib.suppress(BaseException):
                    await started
                theirs.close()
            async with asyncio.timeout(READY_S):
                said = await worker.answer()
            if said != READY or self.closed:
                raise _Gone
        except BaseException:
            worker.end()
            _reap_later(proc)
            raise
        finally:
            self.starting.discard(worker)
        self.live.add(worker)
        self._give(worker)

    def close(self) -> None:
        """Idle and starting workers end now; a busy one finishes its task, its answer dropped
        (its socket is shut down, so the exchange awaiting it ends with ``ParserLost``, and the
        worker exits when it cannot send). Callable with or without a running loop."""
        self.closed = True
        for task in (*self.spawning, *([self.waking] if self.waking else [])):
            task.cancel()
        if self.retry is not None:
            self.retry.cancel()
        for worker in self.idle:
            with contextlib.suppress(RuntimeError):  # the loop is closed: no reader to remove
                self.loop.remove_reader(worker.conn.fileno())
            worker.end()
            _reap_now(worker.proc, 1.0)
        for worker in [*self.starting]:  # a spawn cancelled here may not run again
            worker.end()
        for worker in self.live.difference(self.idle):
            with contextlib.suppress(OSError):
                worker.conn.shutdown(socket.SHUT_RDWR)  # not close: the loop still reads from it
        self.live.difference_update(self.idle)
        self.idle.clear()
        for waiter in self.waiting:
            if not waiter.done():
                waiter.set_exception(ParserLost("the router is stopping"))


def _job(got: Answer) -> Job:
    if isinstance(got, Refused):
        raise RequestRefused(got.message, got.param)
    if isinstance(got, Failed):
        raise RuntimeError(f"the parse worker failed: {got.error}")
    if isinstance(got, Lost | Partial):
        raise RuntimeError(f"a body not lent came back {type(got).__name__}")
    return got


def _retrieved(task: asyncio.Future[Answer | None]) -> None:
    if not task.cancelled():
        task.exception()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _reap_later(proc: BaseProcess) -> None:
    """Reap a killed worker on a thread (the loop does not wait), or now without a running loop."""
    try:
        asyncio.get_running_loop().run_in_executor(None, _reap_now, proc)
    except RuntimeError:
        _reap_now(proc, 1.0)


def _reap_now(proc: BaseProcess, wait_s: float = 10.0) -> None:
    """Wait for a killed worker (no zombie) and close what ``multiprocessing`` holds of it (its
    sentinel pipe)."""
    with contextlib.suppress(ValueError, AssertionError):  # never started, or still running
        proc.join(wait_s)
        proc.close()
