"""Memory of the chaos suite's processes: each one's RSS after its warm-up (``RssBook``) and a
timeline of every process's RSS through the run (``RssSampler``), so growth can be told from a
level the process settles at (the report's ``rss_timeline``, one row a second)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

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


def rss_parts(pid: int) -> dict[str, int]:
    """VmRSS's split: anonymous memory (heaps), file pages (code, libraries), shared memory."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key[3:].lower()] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


class RssBook:
    """Each process's RSS after warm-up, in quiet (nothing in flight, as at the end's figure). A
    restarted process gets the first processes' warm-up: once ``warmup`` more requests have ended
    after it came back (as many as the first warm-up's mix), ``on_done()`` names it; the chaos load
    then holds new requests, lets the ones in flight end, sends the first warm-up's wave at the
    burst's peak concurrency again, waits ``QUIET_S`` and calls ``sample`` before it goes on
    (``harness.chaos.run``). A P's quiet RSS follows what it last had in flight (258 MiB after the
    mix, 700 MiB in a WAN outage): a baseline taken 100 requests after a restart with requests in
    flight read as x1.53 growth at the end, one taken in quiet but without the wave as x1.53-1.68."""

    def __init__(self, warmup: int, heap: Callable[[str], dict[str, Any]] | None = None) -> None:
        """``heap(role)``: where the heap of the role's own process (not its engine child) is now
        (its admin ``/memory``), kept beside each RSS figure to tell live objects from free memory."""
        self.warmup = warmup
        self.heap = heap
        self.base: dict[int, tuple[str, int]] = {}
        self.parts: dict[int, dict[str, int]] = {}  # the baseline's VmRSS split (anon, file, shmem)
        self.heaps: dict[int, dict[str, Any]] = {}  # the baseline's heap figures (the role's process)
        self.ended = 0
        self.pending: dict[str, int] = {}  # role -> requests ended at which its warm-up is over
        self._lock = threading.Lock()

    def restarted(self, role: str) -> None:
        with self._lock:
            self.pending[role] = self.ended + self.warmup

    def on_done(self) -> list[str]:
        """One request ended; the restarted roles whose warm-up is over now (to sample in quiet)."""
        with self._lock:
            self.ended += 1
            due = [role for role, at in self.pending.items() if self.ended >= at]
            for role in due:
                del self.pending[role]
        return due

    def sample(self, cluster: Pids, roles: Sequence[str]) -> None:
        for role in roles:
            for i, pid in enumerate(cluster.pids(role)):
                rss = rss_bytes(pid)
                if rss:
                    self.base[pid] = (role, rss)
                    self.parts[pid] = rss_parts(pid)
                    if i == 0 and self.heap is not None:
                        self.heaps[pid] = self.heap(role)

    def growth(self, cluster: Pids) -> dict[str, float | None]:
        """End RSS / baseline per process ("role:pid"); None: restarted too late for a baseline."""
        out: dict[str, float | None] = {}
        for role in ROLES:
            for pid in cluster.pids(role):
                now = rss_bytes(pid)
                out[f"{role}:{pid}"] = now / self.base[pid][1] if pid in self.base and now else None
        return out

    def parts_report(self, cluster: Pids) -> dict[str, dict[str, dict[str, float]]]:
        """Per process: the baseline's and the end's RSS split in MiB (anon, file, shmem)."""
        out = {}
        for role in ROLES:
            for pid in cluster.pids(role):
                if pid in self.parts:
                    base, end = self.parts[pid], rss_parts(pid)
                    mib = {"base": base, "end": end}
                    out[f"{role}:{pid}"] = {
                        k: {n: round(b / 2**20, 1) for n, b in v.items()} for k, v in mib.items()
                    }
        return out

    def heap_report(self, cluster: Pids) -> dict[str, dict[str, dict[str, Any]]]:
        """Per role process with a baseline: its heap figures then and now (``heap``)."""
        out = {}
        for role in ROLES:
            pids = cluster.pids(role)
            if pids and pids[0] in self.heaps and self.heap is not None:
                out[f"{role}:{pids[0]}"] = {"base": self.heaps[pids[0]], "end": self.heap(role)}
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
