"""Earliest deadline first for P's engine: which waiting prefill goes to the engine next.

P's engine runs its commands one at a time in the order they arrive, so under load a prefill
waits behind every one sent before it. A rescue (a request MD lost, rerun on RelayDecode from the
tokens it has streamed) then waited behind requests that had just arrived with their whole
deadline ahead of them, and missed its own (issue 16, chaos: in a long WAN outage P's prefills
queued for 1.3-2.6 s, and the requests MD lost failed at their deadlines with half their tokens).

``EdfGate(slots)`` lets ``slots`` prefills at the engine at once (two keep it busy while the
sidecar handles one's reply) and hands each free slot to the waiter with the earliest deadline
(arrival order among equal deadlines). A waiter that is cancelled leaves the queue; a slot is
released whatever happens inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

PREFILL_SLOTS = 2


class EdfGate:
    def __init__(self, slots: int = PREFILL_SLOTS) -> None:
        if slots < 1:
            raise ValueError("EdfGate needs at least one slot")
        self.free = slots
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def queued(self) -> int:
        return sum(not f.done() for _, _, f in self._waiting)

    @contextlib.asynccontextmanager
    async def slot(self, deadline: float) -> AsyncIterator[None]:
        """Hold one of the engine's slots; the earliest ``deadline`` among the waiters gets the
        next one that frees."""
        if self.free > 0:  # a free slot means nobody waits (a slot freed goes to a waiter first)
            self.free -= 1
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (deadline, next(self._order), fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._hand_on()  # granted just as we were cancelled: pass the slot on
                raise
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1
