"""Who holds the HTTP server's connection slots, and whose slot goes when they run out (issue 27).

A connection is counted against its owner: at accept, its address (``addr:HOST``); once its
first request head has arrived, the client that head names (``ClientGuard.client_of``: a key's
client with API keys, else the address again). So idle strangers on one address count apart from
a client with a key on the same address, and cannot lock it out.

Phases: ``HEADLESS`` (accepted, no complete request head yet), ``ACTIVE`` (a request is read or
answered), ``IDLE`` (keep-alive, between requests). When a slot is wanted and none is free, the
oldest head-less connection goes first (of the same owner for the per-client cap, of anyone for
the total cap), then, for the total cap, the oldest idle one; only when every connection is busy
is the newcomer refused, and it is refused at once (``Refusal``), never held. A connection that
has sent nothing is also closed after a short first-byte timeout (``pddlink.serving.http``).

Sans-I/O: the caller names connections by an int, passes ``now``, and closes what ``open``
returns in ``evict``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum, auto


class Phase(Enum):
    HEADLESS = auto()
    ACTIVE = auto()
    IDLE = auto()


@dataclass(frozen=True, slots=True)
class SlotRefusal:
    status: int  # 429 (the client's cap) or 503 (the total cap)
    message: str


@dataclass(slots=True)
class _Slot:
    owner: str
    phase: Phase
    since: float


@dataclass(slots=True)
class ConnSlots:
    max_total: int
    max_per_owner: int
    # insertion order is the order of the last phase change: the first of a phase is its oldest
    slots: OrderedDict[int, _Slot] = field(default_factory=OrderedDict)
    counts: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.slots)

    def open(self, conn: int, owner: str, now: float) -> tuple[int, ...] | SlotRefusal:
        """Take a slot for a new connection of ``owner``; the connections to close for it, or a
        refusal (nothing changed)."""
        evict: list[int] = []
        if self.counts.get(owner, 0) >= self.max_per_owner:
            victim = self._oldest(Phase.HEADLESS, owner)
            if victim is None:
                return SlotRefusal(429, "too many connections from this client")
            evict.append(victim)
            self.close(victim)
        if len(self.slots) >= self.max_total:
            victim = self._oldest(Phase.HEADLESS)
            victim = self._oldest(Phase.IDLE) if victim is None else victim
            if victim is None:
                return SlotRefusal(503, "too many connections")
            evict.append(victim)
            self.close(victim)
        self._put(conn, _Slot(owner, Phase.HEADLESS, now))
        return tuple(evict)

    def headed(self, conn: int, owner: str, now: float) -> SlotRefusal | None:
        """``conn``'s request head arrived and names ``owner``: count it there (refused when that
        owner is at its cap; the connection is then to be answered and closed)."""
        slot = self.slots.get(conn)
        if slot is None:
            return None
        if owner != slot.owner:
            if self.counts.get(owner, 0) >= self.max_per_owner:
                return SlotRefusal(429, "too many connections from this client")
            self._count(slot.owner, -1)
            self._count(owner, +1)
            slot.owner = owner
        self._phase(conn, slot, Phase.ACTIVE, now)
        return None

    def idle(self, conn: int, now: float) -> None:
        slot = self.slots.get(conn)
        if slot is not None:
            self._phase(conn, slot, Phase.IDLE, now)

    def close(self, conn: int) -> None:
        slot = self.slots.pop(conn, None)
        if slot is not None:
            self._count(slot.owner, -1)

    def phase(self, conn: int) -> Phase | None:
        slot = self.slots.get(conn)
        return None if slot is None else slot.phase

    def _oldest(self, phase: Phase, owner: str = "") -> int | None:
        for conn, slot in self.slots.items():
            if slot.phase is phase and (not owner or slot.owner == owner):
                return conn
        return None

    def _put(self, conn: int, slot: _Slot) -> None:
        self.slots[conn] = slot
        self._count(slot.owner, +1)

    def _phase(self, conn: int, slot: _Slot, phase: Phase, now: float) -> None:
        slot.phase, slot.since = phase, now
        self.slots.move_to_end(conn)

    def _count(self, owner: str, delta: int) -> None:
        n = self.counts.get(owner, 0) + delta
        if n > 0:
            self.counts[owner] = n
        else:
            self.counts.pop(owner, None)
