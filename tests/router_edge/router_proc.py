"""A real router process for the edge tests: ``pddlink router --config FILE`` on a loopback HTTP
port, its sidecars nowhere (127.0.0.1:9, :10, :11) unless given; stopped on exit. Raw-socket helpers."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cluster import free_port

NOWHERE = {"p": "127.0.0.1:9", "rld": "127.0.0.1:10", "md": "127.0.0.1:11"}


@dataclass(frozen=True, slots=True)
class RouterProc:
    proc: subprocess.Popen[str]
    port: int

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


@contextlib.contextmanager
def router_process(
    tmp: Path,
    api: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    vllm: dict[str, Any] | None = None,
    **top: Any,
) -> Iterator[RouterProc]:
    """``env``: the process's environment (another checkout's PYTHONPATH, to measure a baseline);
    ``vllm``: a ``[vllm]`` table (the router then fronts vLLM servers: ``engine = "vllm"``)."""
    port = free_port()
    table = {**({"engine": "vllm"} if vllm else NOWHERE), "http_port": port, "grpc_port": 0, **top}
    lines = [f"{k} = {_toml(v)}" for k, v in table.items()]
    lines += ["[api]", *(f"{k} = {_toml(v)}" for k, v in (api or {}).items())]
    if vllm:
        lines += ["[vllm]", *(f"{k} = {_toml(v)}" for k, v in vllm.items())]
    conf = tmp / f"router-{port}.toml"
    conf.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pddlink.cli.main", "router", "--config", str(conf)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        yield RouterProc(proc, port)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


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
