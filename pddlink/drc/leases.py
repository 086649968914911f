"""Reservations: MD pins a request's matched prefix under a short lease while P ships the rest.

Lifecycle of one reservation (all times are passed in, seconds on the owner's clock):

    reserve(request_id, hashes, lease_s, now)  -> Reservation   (matched prefix pinned)
    renew(request_id, lease_s, now)            -> Reservation   (optional, while P still ships)
    commit(request_id, hashes, now)            -> events        (full sequence inserted, pin dropped)
  | release(request_id, now)                                    (request abandoned, pin dropped)
  | the lease runs out: handle_timer(now) or any later call     (pin dropped, id remembered as expired)

A call on an id the index does not hold is refused with :class:`ReservationRefused`, whose ``reason``
says why (unknown, expired, duplicate, mismatch, cleared, evicted) and whose ``code`` is the wire
error code.
This module keeps the book of leases; :class:`~pddlink.drc.index.PrefixIndex` does the pinning.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from pddlink.errors import ErrorCode, InvalidInput, LocalError

_REMEMBER_ENDED = 4096  # ended ids kept to answer "expired" instead of "unknown"


class RefusalReason(StrEnum):
    UNKNOWN = "unknown"  # never reserved here (or forgotten long ago, or before a restart)
    EXPIRED = "expired"  # the lease ran out; the prefix may already be evicted
    DUPLICATE = "duplicate"  # the id already holds a live reservation
    MISMATCH = "mismatch"  # committed hashes do not extend the reserved prefix
    CLEARED = "cleared"  # the index was cleared while the reservation was live
    EVICTED = "evicted"  # the engine dropped the reserved prefix under memory pressure


_CODES = {
    RefusalReason.UNKNOWN: ErrorCode.NOT_FOUND,
    RefusalReason.EXPIRED: ErrorCode.LEASE_EXPIRED,
    RefusalReason.DUPLICATE: ErrorCode.BAD_REQUEST,
    RefusalReason.MISMATCH: ErrorCode.BAD_REQUEST,
    RefusalReason.CLEARED: ErrorCode.LEASE_EXPIRED,
    RefusalReason.EVICTED: ErrorCode.LEASE_EXPIRED,
}


class ReservationRefused(LocalError):
    """A reservation call refused; nothing changed. ``reason`` says why."""

    def __init__(self, request_id: str, reason: RefusalReason, detail: str = "") -> None:
        text = f"reservation {request_id!r} refused: {reason.value}" + (f" ({detail})" if detail else "")
        super().__init__(text, code=_CODES[reason])
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Reservation:
    """MD's authoritative answer: ``cached_blocks`` leading blocks are held until ``expires_at_s``."""

    request_id: str
    cached_blocks: int
    total_blocks: int
    tip: int | None  # hash of the last reserved block; None when nothing was cached
    expires_at_s: float

    @property
    def missing_blocks(self) -> int:
        return self.total_blocks - self.cached_blocks


def check_lease_args(request_id: str, lease_s: float) -> None:
    if not request_id:
        raise InvalidInput("request_id must be a non-empty string")
    if not lease_s > 0:
        raise InvalidInput(f"lease_s must be positive, got {lease_s}")


class LeaseBook:
    """Live reservations by request id, plus a bounded memory of how recent ones ended."""

    def __init__(self) -> None:
        self._live: dict[str, Reservation] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; entries checked against _live when popped
        self._ended: OrderedDict[str, RefusalReason] = OrderedDict()
        self.expired_total = 0
        self.refused_total = 0

    def __len__(self) -> int:
        return len(self._live)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def add(self, reservation: Reservation) -> None:
        if reservation.request_id in self._live:
            raise self.refuse(reservation.request_id, RefusalReason.DUPLICATE)
        self._ended.pop(reservation.request_id, None)
        self.replace(reservation)

    def replace(self, reservation: Reservation) -> None:
        self._live[reservation.request_id] = reservation
        heapq.heappush(self._deadlines, (reservation.expires_at_s, reservation.request_id))

    def live(self, request_id: str) -> Reservation:
        """The live reservation, or a refusal saying why there is none."""
        found = self._live.get(request_id)
        if found is None:
            raise self.refuse(request_id, self._ended.get(request_id, RefusalReason.UNKNOWN))
        return found

    def end(self, request_id: str, how: RefusalReason | None) -> Reservation:
        """Drops a live reservation; ``how`` (expired, cleared) is remembered for later refusals."""
        reservation = self._live.pop(request_id)
        if how is not None:
            self._ended[request_id] = how
            if len(self._ended) > _REMEMBER_ENDED:
                self._ended.popitem(last=False)
            if how is RefusalReason.EXPIRED:
                self.expired_total += 1
        return reservation

    def overdue(self, now: float) -> list[str]:
        """Ids whose lease ran out by ``now`` (still live: the caller ends them)."""
        found: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            expires_at_s, rid = heapq.heappop(self._deadlines)
            live = self._live.get(rid)
            if live is not None and live.expires_at_s == expires_at_s and rid not in found:
                found.append(rid)
        return found

    def ids(self) -> list[str]:
        return list(self._live)

    def next_expiry(self) -> float | None:
        heap = self._deadlines
        while heap:
            live = self._live.get(heap[0][1])
            if live is not None and live.expires_at_s == heap[0][0]:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    def refuse(self, request_id: str, reason: RefusalReason, detail: str = "") -> ReservationRefused:
        self.refused_total += 1
        return ReservationRefused(request_id, reason, detail)
