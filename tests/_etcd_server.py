"""A real etcd (Debian's ``etcd-server``) for tests: its own process on loopback, free ports, a
temporary data directory; stop and start again on the same ports and data (an outage).

Use from any test directory (``tests/`` is on ``sys.path`` through ``tests/conftest.py``)::

    from _etcd_server import EtcdServer, etcd_binary

``etcd_binary()`` skips the test where no ``etcd`` is installed, unless ``PDDLINK_REQUIRE_ETCD=1``
(then it fails): CI installs it through scripts/setup.sh.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 20.0


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        reason = (
            "etcd is not installed (Debian: apt-get install etcd-server; scripts/setup.sh does it as root)"
        )
        if os.environ.get("PDDLINK_REQUIRE_ETCD") == "1":
            pytest.fail(f"PDDLINK_REQUIRE_ETCD=1 but {reason}")
        pytest.skip(reason)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One single-member etcd cluster; ``endpoint`` is ``127.0.0.1:<client port>``."""

    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        self.binary = binary or etcd_binary()
        self.data_dir = data_dir
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def _args(self) -> list[str]:
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            *("--name", "pddlink-test", "--data-dir", str(self.data_dir)),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"pddlink-test={peer}", "--initial-cluster-state", "new"),
            *("--logger", "zap", "--log-level", "warn"),
        ]

    def start(self) -> None:
        assert self.proc is None, "already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd did not become healthy on {self.endpoint}:\n{tail}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as reply:
                return b'"true"' in reply.read()
        except (urllib.error.URLError, OSError):
            return False

    def pause(self) -> None:
        """SIGSTOP: sockets stay open, nothing answers (what a partition looks like to a client)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused etcd cannot act on SIGTERM
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
