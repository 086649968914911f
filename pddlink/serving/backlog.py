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

    def will_ship(self, request_id: str) -> None:
        self.pending.add(request_id)

    def started(self, request_id: str, nbytes: int) -> None:
        self.pending.discard(request_id)
        self.shipping[request_id] = nbytes

    def ended(self, request_id: str) -> None:
        self.pending.discard(request_id)
        self.shipping.pop(request_id, None)

    def to_json(self) -> dict[str, Any]:
        return {
            "pending": sorted(self.pending),
            "shipping": [[rid, n] for rid, n in self.shipping.items()],
            "backlog_bytes": sum(self.shipping.values()),
        }


def report_from_status(status: dict[str, Any], at_s: float) -> BacklogReport | None:
    """The ``BacklogReport`` in P's status document, or None when it carries none."""
    wan = (status.get("transfers") or {}).get("wan")
    if not isinstance(wan, dict):
        return None
    shipping = tuple((str(rid), int(n)) for rid, n in wan.get("shipping", []))
    return BacklogReport(shipping, frozenset(str(r) for r in wan.get("pending", [])), at_s)


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
