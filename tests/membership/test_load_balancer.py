"""HAProxy in front of router replicas (``harness.lb``), real haproxy against two small HTTP servers
standing in for routers' HTTP ports: requests alternate per request (keep-alive connections
included), a streamed answer passes through as it is written, and a server whose ``/readyz``
answers 503 gets nothing once its health check has failed. Skips where haproxy is not installed,
unless PDDLINK_REQUIRE_HAPROXY=1 (CI installs it through scripts/setup.sh)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness.lb import HaProxy, LoadBalancerMissing, haproxy_binary


@pytest.fixture(autouse=True)
def _haproxy() -> None:
    try:
        haproxy_binary()
    except LoadBalancerMissing as exc:
        if os.environ.get("PDDLINK_REQUIRE_HAPROXY") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


class Backend:
    """An HTTP server that names itself in every answer; ``ready`` is what /readyz says."""

    def __init__(self, name: str) -> None:
        self.name, self.ready, self.hits = name, True, 0
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.path == "/readyz":
                    self._send(200 if backend.ready else 503, b"{}")
                    return
                backend.hits += 1
                self._send(200, backend.name.encode())

            def do_POST(self) -> None:  # a stream: two chunks, the second after a pause
                self.rfile.read(int(self.headers.get("content-length", 0)))
                backend.hits += 1
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for part in (b"data: first\n\n", b"data: second\n\n"):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                    time.sleep(0.5)
                self.wfile.write(b"0\r\n\r\n")

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def backends() -> Iterator[list[Backend]]:
    bs = [Backend("router0"), Backend("router1")]
    yield bs
    for b in bs:
        b.server.shutdown()
        b.server.server_close()


def test_round_robin_per_request_streams_and_health(tmp_path: Path, backends: list[Backend]) -> None:
    servers = [(b.name, "127.0.0.1", b.port) for b in backends]
    with HaProxy.up(tmp_path, servers) as lb, httpx.Client(timeout=10) as client:
        answers = [client.get(lb.url + "/v1/models").text for _ in range(6)]  # one keep-alive connection
        assert answers == ["router0", "router1"] * 3 or answers == ["router1", "router0"] * 3
        served = lb.served()
        assert served["router0"] >= 3 and served["router1"] >= 3

        t0 = time.monotonic()  # before the request: HAProxy may hold the head with the first chunk
        with client.stream("POST", lb.url + "/v1/completions", content=b"{}") as r:
            lines = r.iter_lines()
            first = next(lines)
            # at once: not held to the end, nor ~200 ms by HAProxy's MSG_MORE (option http-no-delay)
            assert first == "data: first" and time.monotonic() - t0 < 0.15
            assert "data: second" in list(lines)

        backends[1].ready = False
        deadline = time.monotonic() + 10
        while lb.states()["router1"].startswith("UP") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lb.states()["router1"] == "DOWN"
        before = backends[1].hits
        assert {client.get(lb.url + "/v1/models").text for _ in range(4)} == {"router0"}
        assert backends[1].hits == before
    assert lb.proc is None
