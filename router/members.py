"""The router's membership through etcd (``[membership]``): sidecars that announce themselves join
placement, and leave it when their entry goes (a revoked lease at a clean stop, an expired one
after a crash), without a router restart.

``MembershipFollower`` runs a ``pddlink.membership.watcher.MembershipWatcher`` on the cluster's
prefix and applies each change to the backend (``GrpcBackend.add_instance`` / ``remove_instance``):

- a member not in the topology file joins the datacenter its record names (the file gives the
  datacenters and links); a channel of its own checks, with mutual TLS, that the peer at the
  record's address holds a certificate of the deployment's CA naming the record's identity, so a
  record anyone could write to etcd leads to a failed handshake and no traffic. The record's
  identity must be ``<role>/<name>``; its wire version this router's (a sidecar one version
  behind is refused by name, never misread); its engine ``reference``. A refused record is logged
  and counted, never fatal.
- a member of the topology file keeps its place whatever etcd says; its record's ``state``
  (``draining``) drains it.
- etcd unreachable: the watcher keeps its last view, so placement goes on over the last known
  members; ``/status`` (``membership.stale``) and ``pddlink_router_membership_stale`` say so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from pddlink import metrics
from pddlink.errors import InvalidInput
from pddlink.membership import MemberAdded, MemberChanged, MemberRecord, MemberRemoved, MemberState
from pddlink.membership.config import MembershipConfig
from pddlink.membership.view import MembershipChange
from pddlink.topology import Instance, Member
from pddlink.wire import WIRE_VERSION

if TYPE_CHECKING:
    from router.backend import GrpcBackend

log = logging.getLogger(__name__)
GAUGE_EVERY_S = 1.0


def instance_of(record: MemberRecord) -> Member:
    """The topology member a record announces; ``InvalidInput`` for one this router cannot serve."""
    if record.identity != f"{record.role.value}/{record.name}":
        raise InvalidInput(f"identity {record.identity!r} is not {record.role.value}/{record.name}")
    if record.wire_version != WIRE_VERSION:
        raise InvalidInput(f"wire version {record.wire_version}, this router speaks {WIRE_VERSION}")
    if record.engine != "reference":
        raise InvalidInput(f"engine {record.engine!r}: pools serve the reference engine only")
    a = record.addresses
    inst = Instance(record.role, record.name, a.grpc, record.identity, a.admin, kv_address=a.kv)
    return Member(record.datacenter, inst)


class MembershipFollower:
    def __init__(self, backend: GrpcBackend, cfg: MembershipConfig) -> None:
        self.backend, self.cfg = backend, cfg
        self.static = set(backend.fleet.members)  # the topology file's: they stay whatever etcd says
        self.joined: set[str] = set()  # members that joined through etcd and are in the fleet
        self.refused: dict[str, str] = {}  # member id -> why its record was refused
        self.drained: set[str] = set()  # drained because their record says draining
        self.watcher: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        from pddlink.membership.watcher import MembershipWatcher  # aetcd only where etcd is used

        self.watcher = MembershipWatcher(self.cfg.etcd_config(), self.cfg.keys())
        changes = self.watcher.changes()  # subscribed before the first snapshot
        self.watcher.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._apply_all(changes)), loop.create_task(self._gauge())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.watcher is not None:
            await self.watcher.close()

    async def _apply_all(self, changes: Any) -> None:
        async for change in changes:
            try:
                await self.apply(change)
            except InvalidInput as exc:  # the topology would not hold it
                record = change.new if isinstance(change, MemberChanged) else change.record
                self._refuse(record, exc.message)

    async def _gauge(self) -> None:
        while True:
            metrics.MEMBERSHIP_STALE.set(1 if self.watcher.stale else 0)
            await asyncio.sleep(GAUGE_EVERY_S)

    async def apply(self, change: MembershipChange) -> None:
        if isinstance(change, MemberAdded):
            await self._join(change.record)
        elif isinstance(change, MemberRemoved):
            await self._leave(change.record.name)
        elif change.new.addresses != change.old.addresses or change.new.identity != change.old.identity:
            await self._leave(change.old.name)
            await self._join(change.new)
        else:
            self._state(change.new)

    async def _join(self, record: MemberRecord) -> None:
        if record.name in self.static:
            self._state(record)
            return
        try:
            self.backend.add_instance(instance_of(record))
        except InvalidInput as exc:
            self._refuse(record, exc.message)
            return
        self.joined.add(record.name)
        self.refused.pop(record.member_id, None)
        metrics.MEMBERSHIP_CHANGES.labels(change="joined").inc()
        self._state(record)

    async def _leave(self, name: str) -> None:
        if name not in self.joined:
            return
        self.joined.discard(name)
        self.drained.discard(name)
        await self.backend.remove_instance(name)
        metrics.MEMBERSHIP_CHANGES.labels(change="left").inc()

    def _state(self, record: MemberRecord) -> None:
        if record.name not in self.backend.fleet.members:
            return
        draining = record.state is MemberState.DRAINING
        if draining == (record.name in self.drained):
            return  # an operator's drain (``/admin/drain``) is the operator's to undo
        fleet, now = self.backend.fleet, time.monotonic()
        if draining:
            self.drained.add(record.name)
            fleet.drain(record.name, now)
        else:
            self.drained.discard(record.name)
            fleet.undrain(record.name, now)
        metrics.MEMBERSHIP_CHANGES.labels(change="draining" if draining else "serving").inc()

    def _refuse(self, record: MemberRecord, why: str) -> None:
        if self.refused.get(record.member_id) != why:
            log.warning("membership: %s refused: %s", record.member_id, why)
            metrics.MEMBERSHIP_CHANGES.labels(change="refused").inc()
        self.refused[record.member_id] = why

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "etcd": self.cfg.etcd,
            "cluster": self.cfg.cluster,
            "joined": sorted(self.joined),
            "refused": dict(sorted(self.refused.items())),
        }
        if self.watcher is not None:
            h = self.watcher.health()
            now = asyncio.get_running_loop().time()
            out.update(
                stale=h.stale,
                last_ok_s_ago=None if h.last_ok_s is None else round(now - h.last_ok_s, 3),
                errors=h.error_count,
                last_error=h.last_error,
                malformed=h.malformed_now,
                members=h.members,
                revision=h.revision,
            )
        return out
