"""What is queued toward MD, from the sender's transfer state, and how the router follows it.

P keeps a ``WanBook``: every request whose prompt it will ship to MD is *pending* from the moment
its Prefill call arrives (prefilling, reserving at MD), then *shipping* with the exact bytes of
its transfer (the missing suffix, after MD's reservation answer), and gone when the transfer ends
(delivered, failed or past its deadline). P's status document carries it (``transfers.wan``).

``follow_backlog`` runs in the router: it reads P's status every ``interval_s`` and hands the book
to the link model as a ``pddlink.routing.BacklogReport``, so the WAN estimate for a new request
counts the bytes already ahead of it, not a guess. ``md_miss_label`` names why MD did not get the
KV: a transfer that lost to its deadline on a loaded line is congestion, not an unreachable MD.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pddlink.routing import BacklogReport, LinkModel
from pddlink.routing import md_miss_label as md_miss_label  # now pure, in pddlink.routing

POLL_INTERVAL_S = 0.5


@dataclass(slots=True)
class WanBook:
    """P's transfers toward MD: pending request ids and shipping ones with their bytes."""

    pending: set[str] = field(default_factory=set)
    shipping: dict[str, int] = field(default_factory=dict)
    to: dict[str, str] = field(default_factory=dict)  # request id -> the MD it goes to (its identity)

    def will_ship(self, request_id: str, to: str = "") -> None:
        self.pending.add(request_id)
        if to:
            self.to[request_id] = to

    def started(self, request_id: str, nbytes: int) -> None:
        self.pending.discard(request_id)
        self.shipping[request_id] = nbytes

    def ended(self, request_id: str) -> None:
        self.pending.discard(request_id)
        self.shipping.pop(request_id, None)
        self.to.pop(request_id, None)

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


async def follow_pool_backlog(
    p_stubs: Sequence[Any],
    status_request: Any,
    links: Sequence[tuple[LinkModel, Collection[str]]],
    interval_s: float,
    on_pending: Callable[[int, frozenset[str]], None] | None = None,
) -> None:
    """A pool: poll every P's status and give each link model what every P has queued toward the
    MDs behind that link (``links``: each model with its MDs' identities). ``on_pending``: told,
    per P (its index in ``p_stubs``), the request keys it holds before shipping (prefilling or
    reserving), whichever router sent them: what the other routers have queued there."""
    while True:
        replies = await asyncio.gather(
            *(p.Status(status_request, timeout=max(interval_s * 5, 1.0)) for p in p_stubs),
            return_exceptions=True,
        )
        now = time.monotonic()
        docs = []
        for k, reply in enumerate(replies):
            if isinstance(reply, BaseException):
                continue  # that P restarting: the models count the router's own flows for it
            try:
                doc = json.loads(reply.json)
            except ValueError:
                continue
            docs.append(doc)
            if on_pending is not None:
                wan = (doc.get("transfers") or {}).get("wan") or {}
                on_pending(k, frozenset(str(r) for r in wan.get("pending", [])))
        for link, mds in links:
            reports = [r for doc in docs if (r := report_from_status(doc, now, mds)) is not None]
            if reports:
                link.observe_backlog(merge_reports(reports, now))
        await asyncio.sleep(interval_s)


async def follow_backlog(p_stub: Any, status_request: Any, link: LinkModel, interval_s: float) -> None:
    """Poll P's status and feed the link model until cancelled; a failed poll is retried."""
    while True:
        try:
            reply = await p_stub.Status(status_request, timeout=max(interval_s * 5, 1.0))
            report = report_from_status(json.loads(reply.json), time.monotonic())
            if report is not None:
                link.observe_backlog(report)
        except (grpc.aio.AioRpcError, ValueError):
            pass  # P restarting: the link model falls back to the router's own flows
        await asyncio.sleep(interval_s)
