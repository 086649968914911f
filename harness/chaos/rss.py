"""Memory of the chaos suite's processes: each one's RSS after its warm-up (``RssBook``) and a
timeline of every process's RSS through the run (``RssSampler``), so growth can be told from a
level the process settles at (the report's ``rss_timeline``, one row a second)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

ROLES = ("p", "rld", "md", "router")


class Pids(Protocol):
    def pids(self, role: str) -> list[int]: ...


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RssBook:
    """Each process's RSS after warm-up; a restarted one's once ``warmup`` more requests have ended
    after it came back (its own warm-up: as many requests as the first processes' warm-up, the mix
    and the wave at the burst's peak; the load goes on meanwhile, so it is taken in flight, where
    the first processes' is taken in quiet). A baseline taken 40 requests after a restart caught a
    P that had not reached its working size yet (264 MiB; its predecessor ran at 400-470 MiB under
    the same load) and read as x1.53 growth at the end."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.base: dict[int, tuple[str, int]] = {}
        self.ended = 0
        self.pending: dict[str, int] = {}  # role -> requests ended at which to take its baseline
        self._lock = threading.Lock()

    def restarted(self, role: str) -> None:
        with self._lock:
            self.pending[role] = self.ended + self.warmup

    def on_done(self, cluster: Pids) -> None:
        with self._lock:
            self.ended += 1
            due = [role for role, at in self.pending.items() if self.ended >= at]
            for role in due:
                del self.pending[role]
        if due:
            self.sample(cluster, due)

    def sample(self, cluster: Pids, roles: Sequence[str]) -> None:
        for role in roles:
            for pid in cluster.pids(role):
                rss = rss_bytes(pid)
                if rss:
                    self.base[pid] = (role, rss)

    def growth(self, cluster: Pids) -> dict[str, float | None]:
        """End RSS / baseline per process ("role:pid"); None: restarted too late for a baseline."""
        out: dict[str, float | None] = {}
        for role in ROLES:
            for pid in cluster.pids(role):
                now = rss_bytes(pid)
                out[f"{role}:{pid}"] = now / self.base[pid][1] if pid in self.base and now else None
        return out


class RssSampler:
    """Every process's RSS each ``every_s`` in a thread: rows (seconds since start, "role:pid", MiB)."""

    def __init__(self, cluster: Pids, t0: float, every_s: float = 1.0) -> None:
        self.cluster, self.t0, self.every_s = cluster, t0, every_s
        self.rows: list[tuple[float, str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            now = round(time.monotonic() - self.t0, 1)
            for role in ROLES:
                for pid in self.cluster.pids(role):
                    if rss := rss_bytes(pid):
                        self.rows.append((now, f"{role}:{pid}", round(rss / 2**20, 1)))
