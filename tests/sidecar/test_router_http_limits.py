"""The router's HTTP limits that hold across connections (issue 16, item 3): the budget of request
bodies buffered at once over all connections (``body_budget_bytes``: 503 with ``Retry-After``
beyond it, and given back when a body is done), the cap on open connections over all clients
(``max_connections``: 503 at once, a slot again when one closes) and the keep-alive idle timeout
(``idle_timeout_s``: an idle connection closes, a busy one stays).

Real sockets: a router's HTTP server in-process with small limits, raw TCP clients.
"""

from __future__ import annotations

import socket
import time

import pytest

from pddlink.serving.client_guard import ApiConfig
from router.api import RouterApi
from tests.sidecar.test_router_limits import _closed_within, _serve

BODY = 100_000  # max_body_bytes; the budget holds one such body, not two


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5.0)
    return s


def _answer(s: socket.socket) -> bytes:
    """One whole response on ``s`` (head and its ``content-length`` body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = s.recv(65536)
        if not part:
            return data
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    while len(body) < length and (part := s.recv(65536)):
        body += part
    return head + b"\r\n\r\n" + body


def _post_head(length: int) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % length


@pytest.mark.timeout(60)
def test_the_body_budget_holds_across_connections_and_is_given_back() -> None:
    cfg = ApiConfig(max_body_bytes=BODY, body_budget_bytes=BODY + BODY // 2)

    def check(port: int, _api: RouterApi) -> None:
        a = _connect(port)
        a.sendall(_post_head(BODY) + b"x" * (BODY - 10))  # A's body, all but 10 bytes: held
        time.sleep(0.5)
        b = _connect(port)
        b.sendall(_post_head(BODY) + b"x" * (BODY - 10))  # B's would take the budget past its size
        head = _answer(b)
        assert head.startswith(b"HTTP/1.1 503"), head[:200]
        assert b"retry-after: 1" in head.lower() and b"buffering too many request bodies" in head
        b.close()
        a.sendall(b"x" * 10)  # A's body is whole: answered (not JSON: 400), its bytes given back
        head = _answer(a)
        assert head.startswith(b"HTTP/1.1 400"), head[:200]
        a.close()
        for _ in range(2):  # the budget is whole again, however often it is used
            c = _connect(port)
            c.sendall(_post_head(BODY) + b"x" * BODY)
            head = _answer(c)
            assert head.startswith(b"HTTP/1.1 400"), head[:200]
            c.close()

    _serve(cfg, check)


@pytest.mark.timeout(60)
def test_the_connection_cap_over_all_clients_refuses_at_once_and_frees_a_slot() -> None:
    """Every slot busy (each connection mid-upload): a new one is answered 503 at once and closed;
    a slot comes free when one closes. (Idle or head-less connections would be closed to make
    room instead: tests/router_edge/test_connection_slots.py.)"""
    cap = 3
    cfg = ApiConfig(max_connections=cap, max_connections_per_client=64)

    def check(port: int, _api: RouterApi) -> None:
        held = [_connect(port) for _ in range(cap)]
        for s in held:  # each is reading a body: busy, not to be evicted
            s.sendall(_post_head(20) + b"{")
        time.sleep(0.3)  # the server has accepted them and read their heads
        extra = _connect(port)
        t0 = time.monotonic()
        extra.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        head = _answer(extra)
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable"), head[:200]
        assert b"too many connections" in head and b"retry-after: 1" in head.lower()
        assert time.monotonic() - t0 < 1.0
        assert _closed_within(extra, 3.0)  # and the connection is closed
        extra.close()
        for s in held:  # the held ones are served (not JSON: 400)
            s.sendall(b"x" * 19)
            assert _answer(s).startswith(b"HTTP/1.1 400"), s
        held.pop().close()
        got: bytes = b""
        for _ in range(20):  # a slot comes free once the server has seen the close
            time.sleep(0.1)
            s = _connect(port)
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            got = _answer(s)
            s.close()
            if got.startswith(b"HTTP/1.1 200"):
                break
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        for s in held:
            s.close()

    _serve(cfg, check)


@pytest.mark.timeout(60)
def test_an_idle_connection_closes_after_the_idle_timeout_a_busy_one_stays() -> None:
    idle_s = 1.0
    cfg = ApiConfig(idle_timeout_s=idle_s, header_timeout_s=10.0)

    def check(port: int, _api: RouterApi) -> None:
        silent = _connect(port)  # never sends a byte
        t0 = time.monotonic()
        assert _closed_within(silent, 5.0)
        took = time.monotonic() - t0
        assert idle_s * 0.8 < took < idle_s + 1.5, took
        silent.close()

        busy = _connect(port)
        for _ in range(4):  # a request every 0.6 s: 2.4 s in all, each gap shorter than the timeout
            busy.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            assert _answer(busy).startswith(b"HTTP/1.1 200")
            time.sleep(0.6)
        t0 = time.monotonic()  # then idle after its last answer (0.6 s of it gone already)
        assert _closed_within(busy, 5.0)
        assert time.monotonic() - t0 < idle_s + 1.0
        busy.close()

    _serve(cfg, check)
