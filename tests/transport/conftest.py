"""Fixtures for transport tests: a dev PKI, an event-loop runner, and a real TCP relay to cut.

``TcpRelay`` forwards every accepted connection to the real server through real sockets; a test can
cut one relayed connection for real (both sockets reset) or stall all of them, which is how a
broken stripe or a dead path is produced without touching the link's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import uvloop

from pddlink.transport import PeerIdentity, TlsConfig, load_or_create_pki

T = TypeVar("T")
SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")


def run(coro_fn: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    """Run ``coro_fn()`` on a fresh uvloop under a hard timeout."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro_fn(), timeout_s)

    return uvloop.run(bounded())


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[PeerIdentity, TlsConfig]:
    directory = tmp_path_factory.mktemp("pki")
    return load_or_create_pki(directory, [SERVER, CLIENT, PeerIdentity("p", "p1")])


@pytest.fixture(scope="session")
def foreign_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[PeerIdentity, TlsConfig]:
    """Same identities, issued by another CA."""
    return load_or_create_pki(tmp_path_factory.mktemp("foreign"), [SERVER, CLIENT])


class TcpRelay:
    """A byte relay in front of a server; records relayed connections in accept order."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.forwarded: list[int] = []
        self.running = asyncio.Event()
        self.running.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        index = len(self.pairs)
        self.pairs.append((writer, up_writer))
        self.forwarded.append(0)
        for src, dst, count in ((reader, up_writer, True), (up_reader, writer, False)):
            task = asyncio.ensure_future(self._pipe(src, dst, index if count else None))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, index: int | None) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await src.read(1 << 16):
                await self.running.wait()
                dst.write(data)
                await dst.drain()
                if index is not None:
                    self.forwarded[index] += len(data)
        dst.close()

    def cut(self, index: int) -> None:
        """Reset both sockets of relayed connection ``index``, as a broken path would."""
        for writer in self.pairs[index]:
            writer.transport.abort()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pair in self.pairs:
            for writer in pair:
                writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.sleep(0)


@pytest.fixture
def relay_factory() -> Iterator[Callable[[int], TcpRelay]]:
    yield TcpRelay


@pytest.fixture
def run_async() -> Callable[..., Any]:
    return run
