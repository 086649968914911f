"""A mirror of MainDecode's prefix index, kept fresh by its events, for the router and P.

Lifecycle. A mirror starts empty and unsynced. ``apply(event, now)`` takes events in any order and
any number of times: an event whose ``seq`` follows the last applied one is applied at once (then any
buffered successors), an older one is a duplicate and is ignored, a later one waits in a bounded
buffer for the missing ones. ``observe_head(epoch, seq, now)`` takes MD's heartbeat, which reveals a
lost tail. A gap that stays open ``gap_timeout_s`` (or overflows the buffer, or a mirror that joins a
life midway) raises ``needs_resync``: the owner fetches a snapshot (/drc/snapshot) and calls
``load_snapshot``, after which buffered events past the snapshot's ``seq`` apply on top.

Epochs: an event, heartbeat or snapshot from a larger epoch (MD restarted) resets the mirror to that
new, empty life before it is used, so no block of the old life survives; a smaller epoch is a
delayed message of a past life and is ignored.

The mirror answers ``match(hashes)`` like the index (binary search: applied state is always a prefix
tree), and says how stale it is. It only guides the choice of pipeline; MD's reservation decides
what travels. Pure: no I/O, ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pddlink.drc.events import BlocksRemoved, BlocksStored, Event
from pddlink.drc.prefix import PrefixMatch, longest_cached_prefix
from pddlink.drc.snapshot import Snapshot
from pddlink.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class MirrorStaleness:
    epoch: int | None  # None: nothing heard yet
    applied_seq: int  # the index state the mirror holds
    known_seq: int  # the highest seq heard of (events, heartbeats, snapshots)
    since_update_s: float | None  # since the last applied event or snapshot; None: never synced
    since_heard_s: float | None  # since anything arrived from MD; None: never
    needs_resync: bool

    @property
    def seq_lag(self) -> int:
        return self.known_seq - self.applied_seq


class Mirror:
    """Follows one index's event stream; see the module docstring."""

    def __init__(self, *, gap_timeout_s: float = 1.0, max_pending_events: int = 4096) -> None:
        if not gap_timeout_s > 0:
            raise InvalidInput(f"gap_timeout_s must be positive, got {gap_timeout_s}")
        if max_pending_events < 1:
            raise InvalidInput(f"max_pending_events must be >= 1, got {max_pending_events}")
        self._gap_timeout_s = gap_timeout_s
        self._max_pending = max_pending_events
        self._blocks: set[int] = set()
        self._epoch: int | None = None
        self._applied = 0
        self._known = 0
        self._pending: dict[int, Event] = {}
        self._gap_since: float | None = None
        self._needs_resync = False
        self._broken = False  # applied state cannot be trusted until a snapshot arrives
        self._updated_at: float | None = None
        self._heard_at: float | None = None
        self.resets = 0  # new epochs seen
        self.resyncs = 0  # snapshots loaded

    # -- reading -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def applied_seq(self) -> int:
        return self._applied

    @property
    def needs_resync(self) -> bool:
        return self._needs_resync

    def blocks(self) -> frozenset[int]:
        return frozenset(self._blocks)

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        k = longest_cached_prefix(self._blocks, hashes)
        return PrefixMatch(k, len(hashes), hashes[k - 1] if k else None)

    def staleness(self, now: float) -> MirrorStaleness:
        self.handle_timer(now)
        return MirrorStaleness(
            epoch=self._epoch,
            applied_seq=self._applied,
            known_seq=self._known,
            since_update_s=None if self._updated_at is None else now - self._updated_at,
            since_heard_s=None if self._heard_at is None else now - self._heard_at,
            needs_resync=self._needs_resync,
        )

    # -- input ---------------------------------------------------------------------------------

    def apply(self, event: Event, now: float) -> None:
        """Takes one event from MD (possibly lost, duplicated or reordered on the way)."""
        self._heard_at = now
        if not self._follow_epoch(event.epoch, event.seq, now) or event.seq <= self._applied:
            self.handle_timer(now)
            return
        self._known = max(self._known, event.seq)
        if event.seq == self._applied + 1:
            self._apply_one(event)
            self._drain(now)
        else:
            self._pending[event.seq] = event
            while len(self._pending) > self._max_pending:
                del self._pending[min(self._pending)]  # lost for good: the gap stays until a snapshot
                self._needs_resync = True
        self.handle_timer(now)

    def observe_head(self, epoch: int, seq: int, now: float) -> None:
        """MD's heartbeat: its index is at ``(epoch, seq)``."""
        self._heard_at = now
        if self._follow_epoch(epoch, seq, now):
            self._known = max(self._known, seq)
        self.handle_timer(now)

    def load_snapshot(self, snapshot: Snapshot, now: float) -> bool:
        """Replaces the state with ``snapshot``'s unless it is older; True when loaded."""
        self._heard_at = now
        if not self._follow_epoch(snapshot.epoch, 0, now) or snapshot.seq < self._applied:
            return False
        self._blocks = set(snapshot.hashes)
        self._applied = snapshot.seq
        self._known = max(self._known, snapshot.seq)
        for seq in [s for s in self._pending if s <= snapshot.seq]:
            del self._pending[seq]
        self._needs_resync = self._broken = False
        self._gap_since = None
        self.resyncs += 1
        self._drain(now)
        self.handle_timer(now)
        return True

    def handle_timer(self, now: float) -> None:
        """Raises ``needs_resync`` once a gap has stayed open ``gap_timeout_s``."""
        if self._known <= self._applied:
            self._gap_since = None  # a late event closed the gap: no snapshot needed after all
            self._needs_resync = self._broken
            return
        if self._gap_since is None:
            self._gap_since = now
        if now - self._gap_since >= self._gap_timeout_s:
            self._needs_resync = True

    def get_timer(self) -> float | None:
        """When an open gap will call for a resync (None: no gap, or already called for)."""
        if self._gap_since is None or self._needs_resync:
            return None
        return self._gap_since + self._gap_timeout_s

    # -- internals -----------------------------------------------------------------------------

    def _follow_epoch(self, epoch: int, seq: int, now: float) -> bool:
        """False for a past life; resets to a new, empty life on a larger epoch."""
        if self._epoch is not None and epoch < self._epoch:
            return False
        if self._epoch is None or epoch > self._epoch:
            joined_midway = self._epoch is None and seq > 1
            self._blocks.clear()
            self._pending.clear()
            self._epoch, self._applied, self._known = epoch, 0, 0
            self._gap_since, self._needs_resync, self._broken = None, joined_midway, joined_midway
            self._updated_at = now
            self.resets += 1
        return True

    def _drain(self, now: float) -> None:
        while (event := self._pending.pop(self._applied + 1, None)) is not None:
            self._apply_one(event)
        self._updated_at = now

    def _apply_one(self, event: Event) -> None:
        if isinstance(event, BlocksStored):
            if event.parent is not None and event.parent not in self._blocks:
                self._needs_resync = self._broken = True  # cannot happen in order; never build a broken tree
            else:
                self._blocks.update(event.hashes)
        elif isinstance(event, BlocksRemoved):
            self._blocks.difference_update(event.hashes)
        else:
            self._blocks.clear()
        self._applied = event.seq
