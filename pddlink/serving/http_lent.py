"""A request body the HTTP server has not received: handed to the handler as it stands, so that
another process can read it straight from the client's socket (issue 27).

Why: on the router, four concurrent 1 MB bodies cost another client's small request 1.29x its
first-token time when the event loop only received them and dropped them, and 1.57-1.72x when it
also handed them to the parse workers, while the same bodies sent to a process of their own cost it
nothing (1.00x). So a large ``Content-Length`` body on a plaintext connection
(``HttpLimits.lend_body_bytes``) is not read by the server: the connection stops receiving
(``Inbox.hold``) and the handler gets a ``LentBody`` with the bytes already here (``first``) and a
duplicate of the socket (``lend``) for a process that reads the ``rest`` itself, exactly that many
bytes and by the body's deadline. Whoever read it says so (``returned``). A handler that would
rather have the bytes ``read``s them here, as any other body. A client that waits for ``100
Continue`` before it sends a body is told to go on only then: one answered unread never sends it.

After the answer: a body read whole (here or elsewhere) lets the connection go on to its next
request; one never read, or lost part-way, ends the connection (its answer says ``Connection:
close``), since where the next request starts is unknown.

Not over TLS: the bytes on the socket are the TLS records, which only this process can decrypt.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import time

from pddlink.serving.http_inbox import Inbox


class BodyState(enum.Enum):
    UNREAD = "unread"
    READ = "read"  # whole: the connection's next request starts after it
    LOST = "lost"  # part of it was read, or the client left: the connection ends


class LentBody:
    """``size`` bytes declared, ``first`` of them received, the rest still on the socket by
    ``deadline`` (monotonic)."""

    def __init__(self, inbox: Inbox, size: int, first: bytes, deadline: float, go_on: bytes = b"") -> None:
        self.inbox, self.size, self.first, self.deadline = inbox, size, first, deadline
        self.go_on = go_on  # ``100 Continue``, owed to a client that waits for it before sending
        self.state = BodyState.UNREAD
        self.lent_out = False  # ``lend`` gave the socket to a reader

    @property
    def rest(self) -> int:
        """The body's bytes not yet received."""
        return self.size - len(self.first)

    def lend(self) -> socket.socket | None:
        """A duplicate of the connection's socket, for another process to receive ``rest`` bytes
        from (this process receives nothing meanwhile); None when there is nothing left to receive.
        The caller closes it once the reader is done with it (a ``socket.close``, never a
        ``shutdown``: that would end the client's connection) and says how it went (``returned``).
        The duplicate shares the socket's non-blocking mode: a reader uses timeouts, never
        ``setblocking(True)``."""
        if not self.rest:
            return None
        transport = self.inbox.transport
        sock = None if transport is None else transport.get_extra_info("socket")
        if sock is None:
            raise ConnectionError("the connection is gone")
        self._go_on()
        self.lent_out = True
        return socket.socket(fileno=socket.dup(sock.fileno()))

    def _go_on(self) -> None:
        if self.go_on:
            self.inbox.write(self.go_on)  # a few bytes on a connection that has sent nothing yet
            self.go_on = b""

    def returned(self, whole: bool) -> None:
        """The reader that ``lend`` served is done: it received the whole body, or not."""
        self.state = BodyState.READ if whole else BodyState.LOST

    def given_back(self, received: bytes) -> None:
        """The reader that ``lend`` served stopped part-way and gives back what it received (the
        start of the body, ``first`` included): the rest is still on the socket, to ``read``."""
        self.first, self.state = received, BodyState.UNREAD

    def cut(self) -> None:
        """End the client's connection itself, not only this process's descriptor of it, once a
        duplicate was lent: one that a reader has not closed yet (a worker stuck in a parse) would
        keep the connection open."""
        transport = self.inbox.transport
        sock = None if transport is None or not self.lent_out else transport.get_extra_info("socket")
        if sock is None:
            return
        with contextlib.suppress(OSError):
            dup = socket.socket(fileno=socket.dup(sock.fileno()))
            try:
                dup.shutdown(socket.SHUT_RDWR)
            finally:
                dup.close()

    async def read(self) -> bytes:
        """The whole body, received here (``TimeoutError`` past the deadline)."""
        if self.state is not BodyState.UNREAD:
            raise RuntimeError(f"body already {self.state.value}")
        self.state = BodyState.LOST  # until it is whole
        self._go_on()
        self.inbox.let_go()
        async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
            body = await self.inbox.read_body(self.size, first=self.first)
        self.state = BodyState.READ
        return body
