"""A small HTTP/1.1 server on asyncio streams (h11 does the protocol): admin endpoints and the
router's OpenAI-style API. A handler gets a ``Request`` and returns a ``Response`` whose body is
bytes or an async iterator of bytes (sent chunked: server-sent events). One request per connection
at a time; keep-alive supported; every read has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11

MAX_BODY_BYTES = 8 << 20
READ_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: str
    body: bytes


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes | AsyncIterator[bytes] = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = field(default=())


Handler = Callable[[Request], Awaitable[Response]]


def json_response(status: int, obj: Any) -> Response:
    return Response(status, json.dumps(obj).encode() + b"\n")


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    return json_response(status, {"error": {"message": message, "type": kind, "code": status}})


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
        self.reader, self.writer, self.handler = reader, writer, handler
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)

    async def _next_event(self) -> Any:
        while True:
            ev = self.h11.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            data = await asyncio.wait_for(self.reader.read(65536), READ_TIMEOUT_S)
            self.h11.receive_data(data)

    async def _send(self, ev: Any) -> None:
        data = self.h11.send(ev)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def serve(self) -> None:
        while True:
            ev = await self._next_event()
            if isinstance(ev, h11.ConnectionClosed) or ev is h11.PAUSED:
                return
            if not isinstance(ev, h11.Request):
                return
            body = bytearray()
            while True:
                part = await self._next_event()
                if isinstance(part, h11.Data):
                    body += part.data
                    if len(body) > MAX_BODY_BYTES:
                        await self._respond(error_response(413, "request body too large"))
                        return
                elif isinstance(part, h11.EndOfMessage):
                    break
                else:
                    return
            target = ev.target.decode("latin-1")
            path, _, query = target.partition("?")
            try:
                resp = await self.handler(Request(ev.method.decode(), path, query, bytes(body)))
            except Exception as exc:  # a handler bug answers 500 instead of dropping the connection
                resp = error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
            await self._respond(resp)
            if self.h11.our_state is h11.MUST_CLOSE:
                return
            self.h11.start_next_cycle()

    async def _respond(self, resp: Response) -> None:
        headers = [("content-type", resp.content_type), *resp.headers]
        if isinstance(resp.body, bytes):
            headers.append(("content-length", str(len(resp.body))))
            await self._send(h11.Response(status_code=resp.status, headers=headers))
            if resp.body:
                await self._send(h11.Data(data=resp.body))
        else:
            headers.append(("cache-control", "no-cache"))
            await self._send(h11.Response(status_code=resp.status, headers=headers))
            async for chunk in resp.body:
                await self._send(h11.Data(data=chunk))
        await self._send(h11.EndOfMessage())


async def serve_http(
    handler: Handler, *, host: str = "", port: int | None = None, unix: str = ""
) -> list[asyncio.Server]:
    """Listen on ``host:port`` (if port is not None; 0: any free port) and on the unix socket ``unix``."""

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _Conn(reader, writer, handler).serve()
        except (TimeoutError, ConnectionError, h11.ProtocolError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), READ_TIMEOUT_S)

    servers = []
    if port is not None:
        servers.append(await asyncio.start_server(on_client, host or None, port, limit=1 << 20))
    if unix:
        servers.append(await asyncio.start_unix_server(on_client, unix, limit=1 << 20))
    return servers


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def fetch(addr: str, method: str, path: str, body: bytes = b"", timeout_s: float = 10.0) -> tuple[int, bytes]:
    """A blocking HTTP request to ``host:port`` or ``unix:/path`` (admin endpoints, CLI, tests)."""
    if addr.startswith("unix:"):
        conn: http.client.HTTPConnection = _UnixConnection(addr[5:], timeout_s)
    else:
        host, _, port = addr.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, path, body=body or None, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
