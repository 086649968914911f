"""Loopback mode (no root needed): UDP relay with impairments, TCP stream shaping, outages, control."""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from netlab.lab import Lab
from netlab.profile import parse_profile
from netlab.state import relay_pids, run_root

pytestmark = [pytest.mark.netlab, pytest.mark.timeout(60)]


def udp_echo_server() -> tuple[socket.socket, threading.Thread]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)

    def serve() -> None:
        while sock.fileno() >= 0:
            try:
                data, addr = sock.recvfrom(2048)
                sock.sendto(data, addr)
            except (TimeoutError, OSError):
                if sock.fileno() < 0:
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


@pytest.fixture
def lab() -> Iterator[Lab]:
    text = "[link]\ndelay_ms = 5\nloss = 0.05\nrate_mbit = 50\nqueue_packets = 1000\n"
    with Lab.up(parse_profile(text), name="t-loop", mode="loopback") as lab:
        yield lab
    assert not relay_pids("t-loop") and not (run_root() / "t-loop").exists()


def test_udp_forward_delays_and_drops_datagrams(lab: Lab) -> None:
    server, thread = udp_echo_server()
    try:
        host, port = lab.endpoint("dc-b", server.getsockname()[1], "udp")
        assert (host, port) == lab.endpoint("dc-b", server.getsockname()[1], "udp")  # one forward per port
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.settimeout(0.05)
        rtts, n = [], 250
        for i in range(n):
            client.sendto(struct.pack("!Id", i, time.monotonic()), (host, port))
            try:
                data = client.recv(64)
                rtts.append((time.monotonic() - struct.unpack("!Id", data)[1]) * 1e3)
            except TimeoutError:
                pass
        client.close()
    finally:
        server.close()
        thread.join(2)
    assert 9.5 <= statistics.median(rtts) <= 12.0  # 2 x 5 ms one way, plus scheduling
    expected = 1 - 0.95**2
    assert abs((1 - len(rtts) / n) - expected) <= 3 * (expected * (1 - expected) / n) ** 0.5 + 0.01


def test_tcp_forward_is_rate_limited_and_held_during_an_outage(lab: Lab) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[tuple[float, int]] = []

    def sink() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(1 << 16):
                received.append((time.monotonic(), len(data)))

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    host, port = lab.endpoint("dc-b", listener.getsockname()[1], "tcp")
    payload = b"\0" * (6 * 1024 * 1024)  # 6 MiB at 50 Mbit/s: ~1 s
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(payload)
    thread.join(20)
    listener.close()
    elapsed = received[-1][0] - start
    assert sum(n for _, n in received) == len(payload)  # a byte stream: nothing lost
    mbit = len(payload) * 8 / elapsed / 1e6
    assert 40.0 <= mbit <= 52.0, mbit

    lab.outage(0.6)
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[float] = []

    def first_byte() -> None:
        conn, _ = listener.accept()
        with conn:
            if conn.recv(16):
                got.append(time.monotonic())

    thread = threading.Thread(target=first_byte, daemon=True)
    thread.start()
    host, port = lab.endpoint("dc-b", listener.getsockname()[1], "tcp")
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(b"hello")
        thread.join(10)
    listener.close()
    assert got and got[0] - t0 >= 0.45  # held until the link came back


def test_control_refuses_bad_forward(lab: Lab) -> None:
    with pytest.raises(Exception, match="port"):
        lab.endpoint("dc-b", 0, "udp")
    with pytest.raises(Exception, match="proto"):
        lab.endpoint("dc-b", 80, "sctp")
    status = lab.status()
    assert status["mode"] == "loopback" and status["dc-a"] == {"netns": "", "addr": "127.0.0.1"}


def test_cli_loopback_up_prints_forwards_and_down_removes_it() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["pddlink", "lab", "net", *args], capture_output=True, text=True, timeout=60)

    up = cli("up", "--loopback", "--name", "t-cli-loop", "--forward", "udp:dc-b:4433", "--json")
    try:
        assert up.returncode == 0, up.stderr
        out = json.loads(up.stdout)
        assert out["dc-b"] == {"netns": "", "addr": "127.0.0.1"}
        host, port = out["forwards"]["udp:dc-b:4433"].split(":")
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        bad = cli("up", "--loopback", "--name", "t-cli-loop2", "--forward", "icmp:dc-b:1")
        assert bad.returncode != 0 and "PROTO:DC:PORT" in bad.stderr
        assert not (run_root() / "t-cli-loop2").exists()
    finally:
        assert cli("down", "--name", "t-cli-loop").returncode == 0
    assert not relay_pids("t-cli-loop") and not (run_root() / "t-cli-loop").exists()


def test_cli_loopback_up_pins_relay_ports() -> None:
    """``--forward PROTO:DC:PORT=RELAY`` listens on RELAY, so configuration files can name it."""
    import socket as _socket

    from harness.cluster import free_port

    pinned = free_port()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["pddlink", "lab", "net", *args], capture_output=True, text=True, timeout=60)

    up = cli("up", "--loopback", "--name", "t-cli-pin", "--forward", f"tcp:dc-b:4435={pinned}", "--json")
    try:
        assert up.returncode == 0, up.stderr
        assert json.loads(up.stdout)["forwards"]["tcp:dc-b:4435"] == f"127.0.0.1:{pinned}"
        with _socket.create_connection(("127.0.0.1", pinned), timeout=5):
            pass  # the relay accepts on the pinned port
    finally:
        assert cli("down", "--name", "t-cli-pin").returncode == 0


def test_tcp_forward_ends_the_clients_connection_when_the_server_goes_away(lab: Lab) -> None:
    """A server that closed (or died) ends the client's connection through the relay too: the
    client's next read sees the end instead of waiting on a dead upstream for ever."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_once() -> None:
        conn, _ = listener.accept()
        conn.sendall(b"hello")
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # a reset, as a killed process's kernel may send

    thread = threading.Thread(target=serve_once)
    thread.start()
    host, port = lab.endpoint("dc-b", listener.getsockname()[1])
    client = socket.create_connection((host, port), timeout=5.0)
    try:
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := client.recv(64):
                got += chunk
        assert got in (b"", b"hello")  # the end came (a clean end or a reset), not a timeout
    finally:
        client.close()
        listener.close()
        thread.join(2)
