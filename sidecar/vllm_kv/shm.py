"""A shared-memory KV region: one file in /dev/shm that the sidecar creates and vLLM's connector maps.

``region_path`` picks where: /dev/shm (tmpfs, RAM) when it is there, writable and has room for
twice the region, else the given fallback directory (a region on a disk-backed file system works,
but the kernel then writes every KV byte copied into it back to the disk, and a copy into a page
under writeback can wait for it). The file is unlinked by ``close()``; a sidecar killed outright
leaves it in /dev/shm (its name says which sidecar and workdir it was).

The sidecar owns the region and its slot allocator (first fit over free byte ranges, 4 KiB
aligned); the connector only maps the file and reads or writes the byte range a slot names. No KV
byte goes through a socket, protobuf or pickle between them. ``close()`` unlinks the file.

On P a slot holds the blocks the connector copied out of vLLM's paged cache until the WAN transfer
is acked; on MD (the landing region) it holds a transfer that arrived until the connector has copied
it into the blocks vLLM allocated. ``held_bytes``/``held_slots`` are what status and tests read.
"""

from __future__ import annotations

import contextlib
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


class ShmRegion:
    """The sidecar's side: creates the file, hands out and takes back slots (thread-safe)."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise InvalidInput(f"region size must be positive, got {size_bytes}")
        self.path, self.size_bytes = path, _align(size_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.size_bytes)
            self._map = mmap.mmap(fd, self.size_bytes)
        finally:
            os.close(fd)
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
        self.path.unlink(missing_ok=True)


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
