"""The router's view of membership as a sans-I/O machine: store events in, membership changes out.

An adapter (``pddlink.membership.etcd.MembershipWatcher``) feeds it what etcd says:

- ``Snapshot``: every key under the members prefix at one revision (on start and after every
  reconnect); the view replaces its members with it and reports the difference, so a member added
  or lost while etcd was unreachable shows up as one ``MemberAdded`` or ``MemberRemoved``;
- ``KeyPut`` / ``KeyDeleted``: one watch event, applied in revision order;
- ``mark_ok(now)`` / ``mark_error(now, reason)``: whether the store answered.

Each input returns the ``MembershipChange``s it caused. A value that is not a valid record, or a key
outside the layout, is ignored and counted (``malformed_count``); if its key held a valid record,
that member is removed (it no longer announces anything usable). Time is passed in, never read: the
view is stale from an error until the next snapshot, and also when nothing reported ``mark_ok`` for
``stale_after_s`` (a connection that hangs without failing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pddlink.errors import InvalidInput
from pddlink.membership.record import MemberRecord, MembershipKeys, decode_record


@dataclass(frozen=True, slots=True)
class Snapshot:
    entries: tuple[tuple[bytes, bytes], ...]  # (key, value) for every key under the prefix
    revision: int


@dataclass(frozen=True, slots=True)
class KeyPut:
    key: bytes
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class KeyDeleted:
    key: bytes
    revision: int


StoreEvent = Snapshot | KeyPut | KeyDeleted


@dataclass(frozen=True, slots=True)
class MemberAdded:
    record: MemberRecord


@dataclass(frozen=True, slots=True)
class MemberRemoved:
    record: MemberRecord


@dataclass(frozen=True, slots=True)
class MemberChanged:
    old: MemberRecord
    new: MemberRecord


MembershipChange = MemberAdded | MemberRemoved | MemberChanged


@dataclass(frozen=True, slots=True)
class MembershipHealth:
    """What ``/status`` and the metrics show about the view."""

    stale: bool
    last_ok_s: float | None  # the caller's clock; None until the first snapshot
    error_count: int
    last_error: str
    malformed_count: int  # values refused since start (a value re-read by a snapshot counts once)
    malformed_now: int  # keys under the prefix whose value is refused right now
    members: int
    revision: int


class MembershipView:
    def __init__(self, keys: MembershipKeys, *, stale_after_s: float = 5.0) -> None:
        if not stale_after_s > 0:
            raise InvalidInput(f"stale_after_s must be > 0, got {stale_after_s}")
        self.keys = keys
        self.stale_after_s = stale_after_s
        self._members: dict[str, MemberRecord] = {}
        self._malformed: dict[bytes, bytes] = {}  # key -> the refused value
        self._snapshot_revision = 0
        self.revision = 0
        self._synced = False
        self.last_ok_s: float | None = None
        self.error_count = 0
        self.last_error = ""
        self.malformed_count = 0
        self.last_malformed = ""

    @property
    def members(self) -> Mapping[str, MemberRecord]:
        """Current members by ``role/name`` (read-only)."""
        return MappingProxyType(self._members)

    def apply(self, event: StoreEvent, now: float) -> list[MembershipChange]:
        if isinstance(event, Snapshot):
            return self._resync(event, now)
        if event.revision <= self._snapshot_revision:
            return []  # already in the snapshot
        self.revision = max(self.revision, event.revision)
        if isinstance(event, KeyPut):
            return self._put(event.key, event.value)
        return self._delete(event.key)

    def mark_ok(self, now: float) -> None:
        """The store answered (a probe, a snapshot, a watch event) while the watch is in place."""
        if self._synced:
            self.last_ok_s = now

    def mark_error(self, now: float, reason: str) -> None:
        """The store failed or is unreachable: the view keeps its members, but is stale until the
        next snapshot."""
        self._synced = False
        self.error_count += 1
        self.last_error = reason

    def stale(self, now: float) -> bool:
        if not self._synced or self.last_ok_s is None:
            return True
        return now - self.last_ok_s > self.stale_after_s

    def health(self, now: float) -> MembershipHealth:
        return MembershipHealth(
            stale=self.stale(now),
            last_ok_s=self.last_ok_s,
            error_count=self.error_count,
            last_error=self.last_error,
            malformed_count=self.malformed_count,
            malformed_now=len(self._malformed),
            members=len(self._members),
            revision=self.revision,
        )

    def _resync(self, snap: Snapshot, now: float) -> list[MembershipChange]:
        self._synced = True
        self.last_ok_s = now
        self._snapshot_revision = self.revision = snap.revision
        before, refused = self._members, self._malformed
        self._members, self._malformed = {}, {}
        for key, value in snap.entries:
            self._put(key, value, refused_before=refused.get(key))
        after = self._members
        changes: list[MembershipChange] = [MemberRemoved(r) for m, r in before.items() if m not in after]
        for member_id, record in after.items():
            old = before.get(member_id)
            if old is None:
                changes.append(MemberAdded(record))
            elif old != record:
                changes.append(MemberChanged(old, record))
        return changes

    def _put(self, key: bytes, value: bytes, refused_before: bytes | None = None) -> list[MembershipChange]:
        try:
            member_id = self.keys.member_id_of(key)
            record = decode_record(value)
            if record.member_id != member_id:
                raise InvalidInput(f"membership key {key!r} holds the record of {record.member_id}")
        except InvalidInput as exc:
            if value != refused_before:
                self.malformed_count += 1
                self.last_malformed = exc.message
            self._malformed[key] = value
            return self._delete(key, keep_malformed=True)
        self._malformed.pop(key, None)
        old = self._members.get(member_id)
        self._members[member_id] = record
        if old is None:
            return [MemberAdded(record)]
        return [] if old == record else [MemberChanged(old, record)]

    def _delete(self, key: bytes, *, keep_malformed: bool = False) -> list[MembershipChange]:
        if not keep_malformed:
            self._malformed.pop(key, None)
        try:
            member_id = self.keys.member_id_of(key)
        except InvalidInput:
            return []
        old = self._members.pop(member_id, None)
        return [] if old is None else [MemberRemoved(old)]
