"""Give freed heap memory back to the OS (glibc ``malloc_trim``), so RSS follows what is live.

A sidecar's KV buffers (1-2 MiB per request: P's exported KV, a receiver's chunks) are freed when
the request ends, but glibc keeps freed memory in its arenas, one per thread that allocated
(the engine loop, the codec pool, gRPC's threads), and returns only the top of the main heap. After
a burst of 4x the usual concurrency P's RSS stayed at its high-water mark, twice its value after
warm-up, although nothing was held (issue 16, chaos: ``rss_growth_max``). ``malloc_trim(0)`` returns
the free pages of every arena; the sweeper calls it every ``TRIM_EVERY_S``. Where the C library is
not glibc, ``trim`` does nothing and says so.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
from collections.abc import Callable

TRIM_EVERY_S = 10.0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim  # CDLL: the GIL is released during the call
    except (OSError, AttributeError):
        return None  # musl, macOS: no malloc_trim
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int

    def call(pad: int) -> int:
        return int(fn(pad))

    return call


def available() -> bool:
    return _malloc_trim() is not None


async def trim_every(seconds: float = TRIM_EVERY_S) -> None:
    """``trim`` every ``seconds``, for a process without a sweeper (the router)."""
    while True:
        await asyncio.sleep(seconds)
        trim()


def trim() -> bool:
    """Return free heap pages to the OS; True when some memory was released."""
    fn = _malloc_trim()
    return fn is not None and fn(0) == 1
