"""Idle connections do not lock anyone out (issue 27, item 4). 3,000 connections that never send a
byte, from 50 loopback addresses (64 of them on the keyed client's own address), are held open
against a real router process with its default caps (512 in all, 64 per client): the router's open
files stay under its cap + 64 (connections over the cap are closed at once, not held), and a
client with a key is served throughout, in about its unloaded time. Head-less connections are
closed after the first-byte timeout."""

from __future__ import annotations

import http.client
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest

from tests.router_edge.router_proc import RouterProc, closed_within, connect, read_answer, router_process

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

KEY = "k-edge-0123456789abcdef"
CAP = 512  # ApiConfig's default max_connections
FLOOD = 3000


def _keyed_get(port: int) -> float:
    """Seconds to a whole 200 answer of /v1/models on a fresh connection, with the key."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v1/models", headers={"authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
    finally:
        conn.close()
    return time.monotonic() - t0


def _flood(port: int) -> list[socket.socket]:
    sources = ["127.0.0.1"] * 64 + [f"127.0.0.{2 + i % 49}" for i in range(FLOOD - 64)]
    return [connect(port, src) for src in sources]


def test_three_thousand_idle_connections_neither_hold_files_nor_lock_out_a_keyed_client(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    # a first-byte timeout longer than the test: every connection stays idle and head-less
    api = {"api_keys_file": str(keys), "first_byte_timeout_s": 120.0, "rate_per_client_s": 0.0}
    with router_process(tmp_path, api) as router:
        base_files = router.open_files()
        unloaded = statistics.median(_keyed_get(router.port) for _ in range(10))
        peak = [0]
        stop = threading.Event()

        def sample(r: RouterProc = router) -> None:
            while not stop.wait(0.01):
                peak[0] = max(peak[0], r.open_files())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        held = _flood(router.port)
        opened_s = time.monotonic() - t0
        try:
            time.sleep(0.5)
            loaded = [_keyed_get(router.port) for _ in range(10)]
            settled_files = router.open_files()
            stop.set()
            sampler.join()
            print(
                f"\nopen files: {base_files} before, {settled_files} with {FLOOD} idle connections held "
                f"(peak {peak[0]} while they were opened in {opened_s:.2f} s); keyed /v1/models "
                f"median {unloaded * 1000:.1f} ms unloaded, {statistics.median(loaded) * 1000:.1f} ms "
                f"(max {max(loaded) * 1000:.1f} ms) under the flood"
            )
            assert settled_files < CAP + 64 and peak[0] < CAP + 64, (settled_files, peak[0])
            assert statistics.median(loaded) < max(1.5 * unloaded, unloaded + 0.01), loaded
        finally:
            for s in held:
                s.close()


def test_connections_that_send_nothing_close_after_the_first_byte_timeout(tmp_path: Path) -> None:
    with router_process(tmp_path, {"first_byte_timeout_s": 1.0, "idle_timeout_s": 30.0}) as router:
        base_files = router.open_files()
        held = [connect(router.port, f"127.0.0.{2 + i % 8}") for i in range(200)]
        time.sleep(0.5)
        # held, not closed at once (a loaded machine may not have accepted the last few yet)
        assert router.open_files() >= base_files + 190
        t0 = time.monotonic()
        assert all(closed_within(s, 3.0) for s in held)
        took = time.monotonic() - t0
        assert took < 2.5 and router.open_files() <= base_files + 2, took
        for s in held:
            s.close()
        # a keep-alive connection that has sent a request keeps the idle timeout instead
        s = connect(router.port)
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert read_answer(s).startswith(b"HTTP/1.1 200 OK")
        assert not closed_within(s, 2.0)
        s.close()
