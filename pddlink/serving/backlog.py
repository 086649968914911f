"""What is queued toward MD, from the sender's transfer state, and how the router follows it.

P keeps a ``WanBook``: every request whose prompt it will ship to MD is *pending* from the moment
its Prefill call arrives (prefilling, reserving at MD), then *shipping* with the exact bytes of
its transfer (the missing suffix, after MD's reservation answer), and gone when the transfer ends
(delivered, failed or past its deadline). P's status document carries it (``transfers.wan``).

``watch_backlog`` runs in the router: it follows every P's book as P pushes it (``WatchWan``: the
book now, then on each change and at least every ``HEARTBEAT_S``) and hands it to each link model as
a ``pddlink.routing.BacklogReport``, so the WAN estimate for a new request counts the bytes already
ahead of it, whichever router sent them, not a guess. Polling P's whole status every 0.5 s, as the
router did before, showed another router's transfers late or not at all (most last 0.05-0.5 s), and
two routers shipped more and relayed less than one (``pddlink demo --routers 2``). A P that does not
serve ``WatchWan`` (an older one) is polled as before. ``md_miss_label`` names why MD did not get the
KV: a transfer that lost to its deadline on a loaded line is congestion, not an unreachable MD.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pddlink.routing import BacklogReport, LinkModel
from pddlink.routing import md_miss_label as md_miss_label  # now pure, in pddlink.routing

POLL_INTERVAL_S = 0.5  # a P that does not push its book (no ``WatchWan``): its status this often
HEARTBEAT_S = 0.25  # a pushed book goes out at least this often: the link model's report stays fresh
RETRY_S = 0.5  # a P's lost stream is opened again after this


@dataclass(slots=True)
class WanBook:
    """P's transfers toward MD: pending request ids and shipping ones with their bytes."""

    pending: set[str] = field(default_factory=set)
    shipping: dict[str, int] = field(default_factory=dict)
    to: dict[str, str] = field(default_factory=dict)  # request id -> the MD it goes to (its identity)
    _watchers: set[asyncio.Event] = field(default_factory=set, repr=False)
    _closed: bool = False

    def will_ship(self, request_id: str, to: str = "") -> None:
        self.pending.add(request_id)
        if to:
            self.to[request_id] = to
        self._changed()

    def started(self, request_id: str, nbytes: int) -> None:
        self.pending.discard(request_id)
        self.shipping[request_id] = nbytes
        self._changed()

    def ended(self, request_id: str) -> None:
        self.pending.discard(request_id)
        self.shipping.pop(request_id, None)
        self.to.pop(request_id, None)
        self._changed()

    def close(self) -> None:
        """P is stopping: every ``watch`` ends (after the state it has last sent)."""
        self._closed = True
        self._changed()

    def _changed(self) -> None:
        for ev in self._watchers:
            ev.set()

    async def watch(self, heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[dict[str, Any]]:
        """The book now (``to_json``), then after each change (changes that come while the last
        state is being sent go out as one) and at least every ``heartbeat_s``, until ``close``."""
        changed = asyncio.Event()
        self._watchers.add(changed)
        try:
            while not self._closed:
                changed.clear()
                yield self.to_json()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), heartbeat_s)
        finally:
            self._watchers.discard(changed)

    def to_json(self) -> dict[str, Any]:
        return {
            "pending": sorted(self.pending),
            "shipping": [[rid, n] for rid, n in self.shipping.items()],
            "backlog_bytes": sum(self.shipping.values()),
            "to": dict(self.to),
        }


def report_from_status(
    status: dict[str, Any], at_s: float, to: Collection[str] | None = None
) -> BacklogReport | None:
    """The ``BacklogReport`` in P's status document, or None when it carries none. ``to``: only
    the transfers toward these MDs (identities; one WAN link's datacenter), for a P of a pool."""
    wan = (status.get("transfers") or {}).get("wan")
    if not isinstance(wan, dict):
        return None
    target = wan.get("to") or {}

    def keep(rid: str) -> bool:
        return to is None or target.get(rid) in to

    shipping = tuple((str(rid), int(n)) for rid, n in wan.get("shipping", []) if keep(rid))
    pending = frozenset(str(r) for r in wan.get("pending", []) if keep(r))
    return BacklogReport(shipping, pending, at_s)


def merge_reports(reports: Sequence[BacklogReport], at_s: float) -> BacklogReport:
    """Several senders' reports toward one link as one (each P of a pool ships on it)."""
    shipping = tuple(item for r in reports for item in r.shipping)
    return BacklogReport(shipping, frozenset().union(*(r.pending for r in reports)), at_s)


async def watch_backlog(
    p_stubs: Sequence[Any],
    request: Any,
    links: Sequence[tuple[LinkModel, Collection[str] | None]],
    on_pending: Callable[[int, frozenset[str]], None] | None = None,
) -> None:
    """Follow every P's WAN book and give each link model what every P has queued toward the MDs
    behind that link (``links``: each model with its MDs' identities; None: every transfer). Each P
    pushes its book (``WatchWan``); one that does not is polled (``Status``, ``POLL_INTERVAL_S``); a
    P whose stream or poll fails counts for nothing until it answers again (the link models then
    count the router's own flows for it). ``on_pending``: told, per P (its index in ``p_stubs``),
    the request keys it holds before shipping (prefilling or reserving), whichever router sent
    them: what the other routers have queued there. Runs until cancelled."""
    books: dict[int, dict[str, Any]] = {}

    def heard(k: int, doc: dict[str, Any]) -> None:
        books[k] = doc
        if on_pending is not None:
            wan = (doc.get("transfers") or {}).get("wan") or {}
            on_pending(k, frozenset(str(r) for r in wan.get("pending", [])))
        now = time.monotonic()
        for link, mds in links:
            reports = [r for d in books.values() if (r := report_from_status(d, now, mds)) is not None]
            if reports:
                link.observe_backlog(merge_reports(reports, now))

    async def pushed(k: int, stub: Any) -> None:
        async for reply in stub.WatchWan(request):
            heard(k, json.loads(reply.json))

    async def polled(k: int, stub: Any) -> None:
        while True:
            reply = await stub.Status(request, timeout=max(POLL_INTERVAL_S * 5, 1.0))
            heard(k, json.loads(reply.json))
            await asyncio.sleep(POLL_INTERVAL_S)

    async def follow(k: int, stub: Any) -> None:
        read = pushed
        while True:
            try:
                await read(k, stub)  # a pushed stream ends when P stops
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED and read is pushed:
                    read = polled  # an older P: its status, polled
                    continue
            except ValueError:
                pass
            books.pop(k, None)  # P restarting: until it answers, the router's own flows count for it
            await asyncio.sleep(RETRY_S)

    await asyncio.gather(*(follow(k, stub) for k, stub in enumerate(p_stubs)))
