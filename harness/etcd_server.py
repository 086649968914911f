"""A real etcd (Debian's ``etcd-server``) for the demos: its own process on loopback, free ports, a
data directory of the run's; ``stop()`` and ``start()`` again on the same ports and data make an
outage (what the members' leases and the routers' watches see when etcd goes away and comes back).

    with EtcdServer(run_dir / "etcd") as etcd:
        spec = PoolSpec(run_dir, topology, etcd=etcd.endpoint)
        etcd.stop(); time.sleep(30); etcd.start()

Without the binary ``EtcdServer`` raises ``EtcdMissing`` naming the package (the tests' wrapper,
``tests/_etcd_server.py``, skips instead). ``pause()`` / ``resume()`` freeze it with its sockets
open (a partition, as a client sees one).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from harness.cluster import ClusterError, free_port

START_TIMEOUT_S = 20.0


class EtcdMissing(ClusterError):
    """No ``etcd`` binary on this machine."""


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise EtcdMissing(
            "etcd is not installed: `apt-get install etcd-server` (scripts/setup.sh installs it as root)"
        )
    return found


class EtcdServer:
    """One single-member etcd cluster; ``endpoint`` is ``127.0.0.1:<client port>``."""

    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        self.binary = binary or etcd_binary()
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def _args(self) -> list[str]:
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            *("--name", "pddlink-demo", "--data-dir", str(self.data_dir)),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"pddlink-demo={peer}", "--initial-cluster-state", "new"),
            *("--logger", "zap", "--log-level", "warn"),
        ]

    def start(self) -> None:
        if self.proc is not None:
            raise ClusterError("etcd: already running")
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self._args(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ClusterError(f"etcd did not become healthy on {self.endpoint}; see {self.log_path}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as reply:
                return b'"true"' in reply.read()
        except (urllib.error.URLError, OSError):
            return False

    def pause(self) -> None:
        """SIGSTOP: its sockets stay open, nothing answers."""
        if self.proc is None:
            raise ClusterError("etcd: not running")
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is None:
            raise ClusterError("etcd: not running")
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """``sig`` (SIGTERM), then SIGKILL after 10 s; its ports close, its data stays."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
