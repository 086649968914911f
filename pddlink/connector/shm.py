"""A shared-memory KV region: one file in /dev/shm that the sidecar creates and vLLM's connector maps.

``region_path`` picks where: /dev/shm (tmpfs, RAM) when it is there, writable and has room for
twice the region, else the given fallback directory (a region on a disk-backed file system works,
but the kernel then writes every KV byte copied into it back to the disk, and a copy into a page
under writeback can wait for it). The file is unlinked by ``close()``.

A sidecar killed outright cannot unlink it, and a tmpfs file is RAM until someone does (a region is
sized for the KV pool: gigabytes on a real deployment). So the owner holds an exclusive ``flock`` on
its region for as long as it lives (the kernel drops it with the process), and every new region
first sweeps /dev/shm: a ``pddlink-*.kv`` whose lock it can take has no living owner and is
removed (``sweep_stale``). The lock also refuses a second sidecar on the same region while the
first one lives, where ``O_TRUNC`` used to cut the first one's file under it.

The sidecar owns the region and its slot allocator (first fit over free byte ranges, 4 KiB
aligned); the connector only maps the file and reads or writes the byte range a slot names. No KV
byte goes through a socket, protobuf or pickle between them. ``close()`` unlinks the file.

On P a slot holds the blocks the connector copied out of vLLM's paged cache until the WAN transfer
is acked; on MD (the landing region) it holds a transfer that arrived until the connector has copied
it into the blocks vLLM allocated. ``held_bytes``/``held_slots`` are what status and tests read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from pddlink.errors import ErrorCode, InvalidInput, LocalError

ALIGN = 4096


class RegionFull(LocalError):
    code = ErrorCode.CAPACITY


@dataclass(frozen=True, slots=True)
class Slot:
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


SHM_DIR = Path("/dev/shm")


def region_path(workdir: Path, name: str, size_bytes: int, region_dir: Path | None = None) -> Path:
    """Where sidecar ``name`` (of ``workdir``) keeps its region: ``region_dir`` when given, else
    /dev/shm when it can hold twice ``size_bytes``, else ``workdir``."""
    if region_dir is None:
        region_dir = workdir
        with contextlib.suppress(OSError):
            st = os.statvfs(SHM_DIR)
            if os.access(SHM_DIR, os.W_OK) and st.f_bavail * st.f_frsize >= 2 * size_bytes:
                region_dir = SHM_DIR
    if region_dir == workdir:
        return workdir / f"{name}.kv"
    tag = hashlib.blake2b(str(workdir.resolve()).encode(), digest_size=6).hexdigest()
    return region_dir / f"pddlink-{name}-{tag}.kv"


class RegionInUse(LocalError):
    code = ErrorCode.UNAVAILABLE


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


def sweep_stale(directory: Path = SHM_DIR) -> list[Path]:
    """Remove the ``pddlink-*.kv`` regions in ``directory`` that no living sidecar holds (its lock
    is free: the owner was killed before ``close()``); the paths removed."""
    removed = []
    for path in sorted(directory.glob("pddlink-*.kv")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            if _try_lock(fd) and _same_file(fd, path):
                path.unlink(missing_ok=True)
                removed.append(path)
        finally:
            os.close(fd)  # drops the lock
    return removed


def _open_locked(path: Path) -> int:
    """The region's file, created if need be, with this process's exclusive lock on it."""
    for _ in range(8):  # a sweeper may unlink the file between our open and our lock: open it again
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if not _try_lock(fd):
            os.close(fd)
            raise RegionInUse(f"{path} is held by another living sidecar (the same workdir and name)")
        if _same_file(fd, path):
            os.fchmod(fd, 0o600)  # whatever the umask, and whoever created it before
            return fd
        os.close(fd)
    raise RegionInUse(f"{path} kept disappearing while it was being created")


class ShmRegion:
    """The sidecar's side: creates the file, hands out and takes back slots (thread-safe). It holds
    the file's lock until ``close()`` (see the module docstring)."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise InvalidInput(f"region size must be positive, got {size_bytes}")
        self.path, self.size_bytes = path, _align(size_bytes)
        if path.parent == SHM_DIR:
            sweep_stale(SHM_DIR)
        self._fd = _open_locked(path)
        try:
            os.ftruncate(self._fd, 0)  # a dead owner's bytes go; the new region reads as zeros
            os.ftruncate(self._fd, self.size_bytes)
            self._map = mmap.mmap(self._fd, self.size_bytes)
        except BaseException:
            os.close(self._fd)
            raise
        self._free: list[tuple[int, int]] = [(0, self.size_bytes)]  # (offset, length), sorted
        self._held: dict[int, Slot] = {}
        self._lock = threading.Lock()

    @property
    def view(self) -> memoryview:
        return memoryview(self._map)

    @property
    def held_slots(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self._held.values())

    def alloc(self, nbytes: int) -> Slot:
        if nbytes <= 0:
            raise InvalidInput(f"slot size must be positive, got {nbytes}")
        want = _align(nbytes)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= want:
                    if length == want:
                        del self._free[i]
                    else:
                        self._free[i] = (off + want, length - want)
                    slot = Slot(off, nbytes)
                    self._held[off] = slot
                    return slot
        raise RegionFull(f"no {nbytes}-byte slot free in {self.path} ({self.held_bytes} bytes held)")

    def free(self, slot: Slot) -> None:
        with self._lock:
            if self._held.pop(slot.offset, None) is None:
                return  # freed twice (a release racing a sweep): nothing more to do
            self._free.append((slot.offset, _align(slot.nbytes)))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((off, length))
            self._free = merged

    def write(self, slot: Slot, chunks: list[memoryview] | tuple[memoryview, ...]) -> None:
        pos = slot.offset
        for c in chunks:
            n = c.nbytes
            if pos + n > slot.end:
                raise InvalidInput(f"{pos + n - slot.offset} bytes do not fit a {slot.nbytes}-byte slot")
            self._map[pos : pos + n] = c.cast("B") if c.format != "B" else c
            pos += n
        if pos != slot.end:
            raise InvalidInput(f"slot of {slot.nbytes} bytes got {pos - slot.offset}")

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with the process
            self._map.close()
        if self._fd >= 0:
            if _same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
            os.close(self._fd)  # drops the lock
            self._fd = -1


class MappedRegion:
    """The connector's side: maps the sidecar's file read-write (no allocator here)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size_bytes = path, size

    def buffer(self, slot: Slot) -> memoryview:
        if slot.offset < 0 or slot.end > self.size_bytes:
            raise InvalidInput(f"slot {slot} lies outside the {self.size_bytes}-byte region")
        return memoryview(self._map)[slot.offset : slot.end]
