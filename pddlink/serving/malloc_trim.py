"""Give freed heap memory back to the OS (glibc ``malloc_trim``), so RSS follows what is live.

A sidecar's KV buffers (1-2 MiB per request: P's exported KV, a receiver's chunks) are freed when
the request ends, but glibc keeps freed memory in its arenas, one per thread that allocated
(the engine loop, the codec pool, gRPC's threads), and returns only the top of the main heap. After
a burst of 4x the usual concurrency P's RSS stayed at its high-water mark, twice its value after
warm-up, although nothing was held (issue 16, chaos: ``rss_growth_max``). ``malloc_trim(0)`` returns
the free pages of every arena; the sweeper calls it every ``TRIM_EVERY_S``. Where the C library is
not glibc, ``trim`` does nothing and says so.

``trim`` alone was not enough after a restart: glibc's mmap threshold is dynamic (it starts at
128 KiB and rises to the size of each mmapped block that is freed, up to 32 MiB), so after the first
KV buffer is freed every later one comes from the arenas, where a burst leaves them fragmented: a P
restarted mid-run ended its chaos run at 1.44x its RSS after warm-up (378 MiB, 580 MiB at the
burst's peak). ``fix_mmap_threshold`` pins the threshold (``mallopt(M_MMAP_THRESHOLD)``): blocks of
``MMAP_THRESHOLD`` and more are mapped on their own and unmapped when freed, whatever came before.

Neither returns memory that is still referenced, and some of it was, from reference cycles only
the cyclic GC frees: a KV link dropped after a failure (its connection, TLS object and write
buffers), a failed request's frames held by an exception kept in a task. CPython runs a full
collection only once the objects made since the last one outnumber a quarter of the old ones, so a
quiet process can keep such garbage indefinitely (issue 16: a quiet P gave back 34 MiB of 180 to one
``gc.collect()``). ``collect`` runs one before each trim, on the event loop's thread (finalizers of
asyncio objects must run there); ``freeze_startup`` moves the objects alive once a process is up
(modules, classes, descriptors: 51,000 in a sidecar) out of the collector's view, so a full
collection takes well under a millisecond instead of ~45 ms on a busy two-core machine.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import functools
import gc
import sys
import urllib.parse
from collections.abc import Callable
from typing import Any

TRIM_EVERY_S = 5.0  # what a burst left is back within 5 s of its end (a 10 s quiet sees two)
MMAP_THRESHOLD = 256 << 10  # KV buffers (a block's bytes and more) are mapped on their own
# An engine process's: its KV buffers (MiBs a command) are still mapped on their own, while a
# prefill's activations under 1 MiB come from the heap. At 256 KiB each of them was a fresh mapping
# faulted in page by page: the tiny preset prefilled 26-28K tokens/s against 40-42K with glibc's
# default and 37K at 1 MiB (``pddlink bench engine``, one thread, same machine).
ENGINE_MMAP_THRESHOLD = 1 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
KEEP_HEAP_BYTES = 32 << 20  # ``keep_heap``: glibc's largest mmap threshold on 64-bit


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``nbytes`` (see the module docstring); True where it took."""
    return _mallopt(_M_MMAP_THRESHOLD, nbytes)


def keep_heap(nbytes: int = KEEP_HEAP_BYTES) -> bool:
    """The opposite trade, for a process that allocates and frees the same few large buffers over
    and over (a parse worker: a body, its copy, the prompt's text, ~1 MB each): blocks under
    ``nbytes`` come from the heap and the heap's freed top is kept, instead of being handed back
    (``brk``) and faulted in again, page by page, for the next request. Measured on a worker
    parsing 1 MB bodies: 4 ``brk`` calls per body and 2.5-2.8 ms of CPU per body, most of it
    zeroing fresh pages; the heap stays at its high-water mark (a few bodies). True where it took."""
    return _mallopt(_M_TRIM_THRESHOLD, nbytes) and _mallopt(_M_MMAP_THRESHOLD, nbytes)


def _mallopt(param: int, value: int) -> bool:
    lib = _libc()
    fn = getattr(lib, "mallopt", None) if lib is not None else None
    if fn is None:
        return False  # not glibc
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return int(fn(param, value)) == 1


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    lib = _libc()
    if lib is None:
        return None
    try:
        fn = lib.malloc_trim  # CDLL: the GIL is released during the call
    except (OSError, AttributeError):
        return None  # musl, macOS: no malloc_trim
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int

    def call(pad: int) -> int:
        return int(fn(pad))

    return call


def available() -> bool:
    return _malloc_trim() is not None


def freeze_startup() -> None:
    """Once a process is up: what is alive now lives as long as the process, so the cyclic GC need
    not walk it again (``gc.freeze``; see the module docstring)."""
    gc.freeze()


def collect() -> int:
    """A full collection of unreachable cycles, on the caller's (the event loop's) thread."""
    return gc.collect()


async def release() -> bool:
    """``collect``, then ``trim`` off the event loop; True when the trim released memory."""
    collect()
    return await asyncio.to_thread(trim)


async def trim_every(seconds: float = TRIM_EVERY_S) -> None:
    """``release`` every ``seconds``, for a process without a sweeper (the router)."""
    while True:
        await asyncio.sleep(seconds)
        await release()


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


def heap_stats(top_types: int = 0) -> dict[str, Any]:
    """Where a process's heap memory is, for telling growth from a level it settles at (the chaos
    suite's RSS figures): ``py_blocks``, the interpreter's live small objects (pymalloc blocks;
    their arenas are mappings of their own, outside malloc's figures), ``gc_objects`` (what the
    collector tracks, the frozen startup objects aside), and glibc's figures over every arena
    (``mallinfo2``): ``malloc_in_use``, ``malloc_free`` (freed, kept in the arenas),
    ``malloc_mapped`` (blocks mapped on their own: KV buffers). ``top_types``: that many of the
    most numerous tracked types with their counts (``types``), to name what grew. Tens of ms on a
    busy sidecar: asked for (admin ``/memory``), never polled."""
    tracked = gc.get_objects()
    out: dict[str, Any] = {"py_blocks": sys.getallocatedblocks(), "gc_objects": len(tracked)}
    if top_types:
        counts = collections.Counter(type(o).__qualname__ for o in tracked)
        out["types"] = dict(counts.most_common(top_types))
    del tracked
    lib = _libc()
    fn = getattr(lib, "mallinfo2", None) if lib is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = [], _MallInfo2
        info = fn()
        out |= {"malloc_in_use": info.uordblks, "malloc_free": info.fordblks, "malloc_mapped": info.hblkhd}
        out["malloc_mapped_blocks"] = info.hblks  # their count: the mean size says what they are
    return out


def types_asked(query: str) -> int:
    """``/memory?types=N``: how many types ``heap_stats`` lists (0 when absent or not a number)."""
    value = urllib.parse.parse_qs(query).get("types", ["0"])[0]
    return max(int(value), 0) if value.isdigit() else 0


def trim() -> bool:
    """Return free heap pages to the OS; True when some memory was released."""
    fn = _malloc_trim()
    return fn is not None and fn(0) == 1
