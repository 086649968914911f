"""Reservation ids for the DRC's request-keyed leases (MD's answers to ``Reserve``/``Release``).

The DRC pins a prefix per request id; the wire names a reservation by a 64-bit id. Each granted
``Reserve`` gets a fresh id; ``Release`` of an id drops the pin of its request, unless a later
``Reserve`` of the same request superseded it (then the stale id releases nothing). The book is
bounded: ids of leases that were never released (committed by the KV import, or expired) are
forgotten oldest first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

MAX_IDS = 4096


class ReservationIds:
    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self._ids = itertools.count(1)
        self._request_of: OrderedDict[int, str] = OrderedDict()
        self._latest: dict[str, int] = {}
        self.max_ids = max_ids

    def grant(self, request_id: str) -> int:
        rid = next(self._ids)
        self._request_of[rid] = request_id
        self._latest[request_id] = rid
        while len(self._request_of) > self.max_ids:
            old, req = self._request_of.popitem(last=False)
            if self._latest.get(req) == old:
                del self._latest[req]
        return rid

    def release(self, reservation_id: int) -> str | None:
        """The request whose pin ``reservation_id`` still names (None: unknown, stale or forgotten)."""
        req = self._request_of.pop(reservation_id, None)
        if req is None or self._latest.get(req) != reservation_id:
            return None
        del self._latest[req]
        return req
