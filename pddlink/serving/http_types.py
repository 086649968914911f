"""The HTTP server's data: limits, a request, a response, the handler and connection-gate
contracts, and error bodies in vLLM's shape (``pddlink.serving.http`` serves them;
``pddlink.serving.http_conn`` reads and answers one connection's requests)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

from pddlink.serving.http_lent import LentBody
from pddlink.serving.write_bound import SEND_BUFFER_BYTES, WRITE_STALL_S

MAX_BODY_BYTES = 8 << 20
READ_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_body_bytes: int = MAX_BODY_BYTES
    body_budget_bytes: int = 256 << 20
    header_timeout_s: float = READ_TIMEOUT_S
    body_timeout_s: float = READ_TIMEOUT_S
    idle_timeout_s: float = 60.0
    retry_after_s: int = 1
    write_stall_s: float = WRITE_STALL_S  # one write's bytes must be taken by the client within this
    send_buffer_bytes: int = SEND_BUFFER_BYTES  # each connection's kernel send buffer (SO_SNDBUF)
    first_byte_timeout_s: float = READ_TIMEOUT_S  # a new connection's first byte must come within this
    # a Content-Length body this large on a plaintext connection is handed to the handler unread
    # (``Request.lent``: ``pddlink.serving.http_lent``); 0: every body is read first
    lend_body_bytes: int = 0
    lend_paths: tuple[
        str, ...
    ] = ()  # the request paths whose bodies may be lent (their handlers read ``lent``)


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()  # names in lower case
    peer: str = ""  # the client's address ("" on a unix socket)
    lent: LentBody | None = None  # the body, not yet received (``body`` is then b"")

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes | AsyncIterator[bytes] = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = field(default=())
    send_by: float = math.inf  # monotonic time by which the client must have taken the whole answer


Handler = Callable[[Request], Awaitable[Response]]


class ConnectionGate(Protocol):
    """Admits connections and follows their phases (``pddlink.serving.conn_slots``); connections are
    named by an int. ``opened`` answers the connections to close to make room, or a refusal;
    ``headed`` may refuse a connection once its request head names the client."""

    def opened(self, conn: int, peer: str, now: float) -> tuple[int, ...] | Response: ...

    def headed(self, conn: int, peer: str, authorization: str | None, now: float) -> Response | None: ...

    def idled(self, conn: int, now: float) -> None: ...

    def closed(self, conn: int) -> None: ...


def json_response(status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(obj).encode() + b"\n", headers=headers)


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", retry_after_s: int = 0
) -> Response:
    """vLLM's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    headers = (("retry-after", str(retry_after_s)),) if retry_after_s else ()
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return json_response(status, body, headers)


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
