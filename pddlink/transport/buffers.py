"""A pool of receive buffers, so MiB-sized chunk payloads do not fault fresh pages in every time.

A new 4 MiB ``bytearray`` costs about a thousand page faults (milliseconds of CPU) on first touch;
at tens of Gbit/s that is most of a receiver's CPU. Frame payloads are read into buffers from this
pool; a consumer that is done with a ``ReceivedTransfer`` calls ``release()`` and the buffers come
back. Buffers never released are simply garbage collected. The pool is bounded.

Buffers come in size classes (``size_class``: eight a power of two, so at most 1/8 is spare), and
``acquire`` hands out a view of the size asked for. A pool keyed by exact sizes kept a buffer for
every payload size it ever saw: a transfer's last chunk and every compressed chunk has a size of
its own, seldom seen again, so an MD receiving the WAN codec kept every transfer's buffer until the
512 MiB bound (chaos, vLLM: 92 more mapped blocks, 42 MiB, and 19 MiB of heap in a quiet MD, RSS
x1.10 of its warm-up). With classes every buffer kept fits later payloads, and what the pool keeps
is what was out at once, not what ever went by; ``release`` keeps only buffers of a class size.
"""

from __future__ import annotations

from collections import defaultdict

_STEPS_BITS = 3  # 2**3 size classes between two powers of two


def size_class(size: int) -> int:
    """The size of the buffer that holds ``size`` bytes: ``size`` rounded up to the next of eight
    steps between two powers of two (a power of two is a class of its own: 4 MiB chunks fit)."""
    step = 1 << max(0, (size - 1).bit_length() - 1 - _STEPS_BITS)
    return -(-size // step) * step


class BufferPool:
    """Free buffers by size class, at most ``max_bytes`` kept. One event loop; not thread safe."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: defaultdict[int, list[bytearray]] = defaultdict(list)
        self._kept = 0
        self.reused = 0
        self.allocated = 0

    @property
    def kept_bytes(self) -> int:
        return self._kept

    def acquire(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes; its ``obj`` is the buffer to ``release`` later."""
        whole = size_class(size)
        free = self._free.get(whole)
        if free:
            self._kept -= whole
            self.reused += 1
            buffer = free.pop()
        else:
            self.allocated += 1
            buffer = bytearray(whole)
        return memoryview(buffer)[:size]

    def release(self, buffer: bytearray) -> None:
        """Keep ``buffer`` for reuse (when it is of a class size and the bound leaves room)."""
        size = len(buffer)
        if size != size_class(size) or self._kept + size > self.max_bytes:
            return  # not one of ours (a decoded copy): no later payload would be given it
        self._free[size].append(buffer)
        self._kept += size


RECEIVE_POOL = BufferPool()
