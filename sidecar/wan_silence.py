"""Noticing a WAN link that has gone silent (an outage that black-holes its packets) long before
the deadlines of what waits on it, so P's reply says at once that MD will not get the KV.

Why: a P->MD shipment gets ``WAN_SHARE_OF_DEADLINE`` of the request's deadline (6 s of 10). When
the WAN is cut, TCP keeps the bytes and says nothing: the reservation and the transfer waited out
those 6 s, and only then did the router move the request to RelayDecode, with too little of its
deadline left to decode 48 tokens there (issue 16, chaos: 10 of 50 requests in flight when a long
outage began failed this way, all of them shipments to MD).

How: while anything waits on a link (a dial, a reservation, a transfer), ``LinkSilence`` probes it
with a ``Ping`` every ``bound / PROBES_PER_BOUND`` and watches the link's received bytes (pongs,
acks, answers). A waiter that has heard nothing from the link for ``silence_bound`` seconds since
it began is ended with ``Unavailable`` (``PEER_UNREACHABLE``): the caller's fallback runs now,
and the link is dialled anew on its next use. A congested but live link answers pings (its
smoothed RTT, queueing included, sets the bound), so it is never taken for a silent one.

``Silence`` is the sans-I/O core (time and byte counts passed in); ``LinkSilence`` the asyncio glue
one ``sidecar.peers.KVPeer`` owns. ``CallSilence`` does the same for a gRPC call to a peer across
the WAN (RLD's token-id handoff to MD, ``sidecar.peers.DecoderPeer``): gRPC shows no byte counts,
so the peer's own ``Ping`` answers are what is heard. Without it a one-shot handoff begun just
before an outage held RLD's stopped request until the request's deadline: RLD had stopped decoding
to hand over, and resumed only when the call failed (chaos: 4 of the 9 outage-stranded requests
that failed, each with 3-4 tokens streamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TypeVar

from pddlink.errors import ErrorCode, PddlinkError, Unavailable
from pddlink.transport import KVClient
from pddlink.wire import Ping

T = TypeVar("T")

SILENCE_MIN_S = 1.0  # a loaded peer's event loop answers a ping well within this
SILENCE_RTTS = 8  # a live link answers within a few RTTs, queueing included
PROBES_PER_BOUND = 4


def silence_bound(rtt_s: float | None, floor_s: float = SILENCE_MIN_S) -> float:
    """Seconds without a byte from the peer after which a waiter counts the link as silent."""
    return max(floor_s, SILENCE_RTTS * (rtt_s or 0.0))


@dataclass(slots=True)
class Silence:
    """When the link was last heard from: the received-byte count of its current client changed,
    or a new client connected (its handshake was heard)."""

    heard_at: float = -math.inf
    _seen: tuple[int, int] | None = field(default=None, repr=False)  # (client id, bytes received)

    def observe(self, now: float, client_id: int, bytes_received: int) -> None:
        seen = (client_id, bytes_received)
        if seen != self._seen:
            self._seen, self.heard_at = seen, now

    def silent_for(self, now: float, since: float) -> float:
        """How long a waiter that began at ``since`` has heard nothing from the link."""
        return now - max(since, self.heard_at)


class LinkSilence:
    """Ends what waits on a silent link (see the module docstring). ``current()`` gives the link's
    connected client or None; the probe loop runs only while something waits."""

    def __init__(self, addr: str, current: Callable[[], KVClient | None], floor_s: float = SILENCE_MIN_S):
        self.addr, self.current, self.floor_s = addr, current, floor_s
        self.state = Silence()
        self.silenced = 0  # waiters ended by silence (the link's stats)
        self._waiters: dict[asyncio.Future[str], float] = {}
        self._task: asyncio.Task[None] | None = None
        self._nonces = itertools.count(1)
        self._ping: asyncio.Task[None] | None = None

    async def guard(self, what: str, aw: Awaitable[T]) -> T:
        """``aw``'s result, or ``Unavailable`` once the link has been silent for the bound."""
        loop = asyncio.get_running_loop()
        work = asyncio.ensure_future(aw)
        silent: asyncio.Future[str] = loop.create_future()
        self._waiters[silent] = time.monotonic()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._probe())
        try:
            await asyncio.wait((work, silent), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            self._waiters.pop(silent, None)
        if work.done():
            silent.cancel()
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, PddlinkError, TimeoutError, OSError):
            await work
        self.silenced += 1
        raise Unavailable(f"{what}: {silent.result()}", code=ErrorCode.PEER_UNREACHABLE)

    def _bound(self, client: KVClient | None) -> float:
        rtt = client.stats().rtt_s if client is not None else None
        return silence_bound(rtt, self.floor_s)

    async def _probe(self) -> None:
        while self._waiters:
            client = self.current()
            now = time.monotonic()
            if client is not None:
                self.state.observe(now, id(client), client.stats().bytes_received)
            bound = self._bound(client)
            for fut, since in list(self._waiters.items()):
                quiet = self.state.silent_for(now, since)
                if quiet >= bound and not fut.done():
                    fut.set_result(f"nothing heard from {self.addr} for {quiet:.1f} s (the WAN is silent)")
            if client is not None and client.usable and (self._ping is None or self._ping.done()):
                self._ping = asyncio.get_running_loop().create_task(self._send_ping(client, bound))
            await asyncio.sleep(bound / PROBES_PER_BOUND)
        if self._ping is not None:
            self._ping.cancel()

    async def _send_ping(self, client: KVClient, timeout_s: float) -> None:
        with contextlib.suppress(PddlinkError, TimeoutError, OSError):
            await client.request(Ping(next(self._nonces), time.monotonic_ns()), timeout_s=timeout_s)


class CallSilence:
    """Ends a call to a peer once nothing has come back from it for the silence bound: while the
    call waits, ``ping(timeout_s)`` goes out every ``bound / PROBES_PER_BOUND`` (one at a time),
    and each answer counts as heard (its round trip sets the bound, as a KV link's RTT does). A
    peer that is busy but reachable answers its pings, so a slow call is never taken for a dead
    link; only the whole deadline, the call's own timeout, ends that."""

    def __init__(
        self,
        addr: str,
        ping: Callable[[float], Coroutine[None, None, None]],
        floor_s: float = SILENCE_MIN_S,
    ) -> None:
        self.addr, self.ping, self.floor_s = addr, ping, floor_s
        self.rtt_s: float | None = None  # the last answered ping's round trip
        self.silenced = 0

    async def guard(self, what: str, aw: Awaitable[T]) -> T:
        work = asyncio.ensure_future(aw)
        state = Silence()
        since = time.monotonic()
        ping: asyncio.Task[None] | None = None

        async def probe(timeout_s: float) -> None:
            sent = time.monotonic()
            with contextlib.suppress(PddlinkError, TimeoutError, OSError):
                await self.ping(timeout_s)
                now = time.monotonic()
                state.heard_at, self.rtt_s = now, now - sent

        try:
            while True:
                bound = silence_bound(self.rtt_s, self.floor_s)
                await asyncio.wait((work,), timeout=bound / PROBES_PER_BOUND)
                if work.done():
                    return work.result()
                now = time.monotonic()
                quiet = state.silent_for(now, since)
                if quiet >= bound:
                    self.silenced += 1
                    raise Unavailable(
                        f"{what}: nothing heard from {self.addr} for {quiet:.1f} s (the WAN is silent)",
                        code=ErrorCode.PEER_UNREACHABLE,
                    )
                if ping is None or ping.done():
                    ping = asyncio.get_running_loop().create_task(probe(bound))
        finally:
            for task in (work, ping):
                if task is not None and not task.done():
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, PddlinkError, TimeoutError, OSError):
                if ping is not None:
                    await ping
