"""A pool of receive buffers, so MiB-sized chunk payloads do not fault fresh pages in every time.

A new 4 MiB ``bytearray`` costs about a thousand page faults (milliseconds of CPU) on first touch;
at tens of Gbit/s that is most of a receiver's CPU. Frame payloads are read into buffers from this
pool; a consumer that is done with a ``ReceivedTransfer`` calls ``release()`` and the buffers come
back. Buffers never released are simply garbage collected. The pool is bounded.
"""

from __future__ import annotations

from collections import defaultdict


class BufferPool:
    """Free buffers by exact size, at most ``max_bytes`` kept. One event loop; not thread safe."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: defaultdict[int, list[bytearray]] = defaultdict(list)
        self._kept = 0
        self.reused = 0
        self.allocated = 0

    def acquire(self, size: int) -> bytearray:
        free = self._free.get(size)
        if free:
            self._kept -= size
            self.reused += 1
            return free.pop()
        self.allocated += 1
        return bytearray(size)

    def release(self, buffer: bytearray) -> None:
        size = len(buffer)
        if self._kept + size <= self.max_bytes:
            self._free[size].append(buffer)
            self._kept += size


RECEIVE_POOL = BufferPool()
