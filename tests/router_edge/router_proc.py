"""The edge tests' router process (``harness.router_proc``) and raw-socket helpers."""

from __future__ import annotations

import socket
import time

from harness.router_proc import NOWHERE, RouterProc, router_process

__all__ = [
    "NOWHERE", "RouterProc", "closed_within", "connect", "read_answer", "read_answers", "router_process",
]  # fmt: skip


def connect(port: int, source: str = "", timeout_s: float = 5.0) -> socket.socket:
    s = socket.create_connection(
        ("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0) if source else None
    )
    s.settimeout(timeout_s)
    return s


def read_answer(s: socket.socket) -> bytes:
    """One whole response (head and its ``content-length`` body), or what came before the close."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = s.recv(65536)
        if not part:
            return data
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length and (part := s.recv(65536)):
        body += part
    return head + b"\r\n\r\n" + body


def read_answers(s: socket.socket, n: int) -> list[bytes]:
    """``n`` whole responses that may arrive together (pipelined requests), each head and body."""
    data, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in data:
            part = s.recv(65536)
            if not part:
                return out
            data += part
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length and (part := s.recv(65536)):
            rest += part
        out.append(head + b"\r\n\r\n" + rest[:length])
        data = rest[length:]
    return out


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the server closes the connection (EOF or reset) before ``seconds`` pass."""
    s.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while s.recv(65536):
            if time.monotonic() > end:
                return False
        return True
    except TimeoutError:
        return False
    except OSError:
        return True
