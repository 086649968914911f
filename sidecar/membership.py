"""A sidecar's membership through etcd (``[membership]`` in its file; off by default).

Every sidecar announces itself (``pddlink.membership.registrar.Registrar``): its record (name,
role, datacenter, the addresses it serves on, its identity ``<role>/<name>``, engine kind, wire
version) under a lease it keeps alive; a clean stop revokes the lease, a crash lets it expire. P and
RLD also follow the members: an MD (for P also an RLD) that announces itself becomes a peer by
identity, as the topology file's instances are (P ships to it, RLD hands over to it), so the
router may place requests there without restarting anything. A peer's certificate is checked on
connect (mutual TLS, required with membership): a record names whom to expect, not whom to trust.
Peers that leave stay known (nothing is placed on them any more; a dial to a dead one fails typed).

Lifecycle: ``SidecarMembership(sidecar)``; ``start(ports)`` once serving (the bound ports are in the
record); ``close()`` first thing on stop (the router sees the member leave before the listeners go).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from pddlink.membership import MemberAdded, MemberAddresses, MemberChanged, MemberRecord
from pddlink.membership.view import MembershipChange
from pddlink.roles import Role
from pddlink.transport import PeerIdentity
from pddlink.wire import WIRE_VERSION

if TYPE_CHECKING:
    from pddlink.membership.registrar import Registrar
    from pddlink.membership.watcher import MembershipWatcher
    from sidecar.reference import ReferenceSidecar

log = logging.getLogger(__name__)


def own_record(sidecar: ReferenceSidecar, ports: dict[str, Any]) -> MemberRecord:
    cfg = sidecar.cfg
    host = cfg.host

    def at(port: Any) -> str:
        return f"{host}:{port}" if port else ""

    addresses = MemberAddresses(
        grpc=at(ports["grpc_port"]), kv=at(ports.get("kv_port")), admin=at(ports.get("admin_port"))
    )
    return MemberRecord(
        role=Role(cfg.role),
        datacenter=cfg.membership.datacenter,
        name=cfg.name,
        addresses=addresses,
        identity=sidecar.identity.common_name,
        engine=cfg.engine_kind,
        wire_version=WIRE_VERSION,
    )


class SidecarMembership:
    def __init__(self, sidecar: ReferenceSidecar) -> None:
        self.sidecar = sidecar
        self.cfg = sidecar.cfg.membership
        self.registrar: Registrar | None = None
        self.watcher: MembershipWatcher | None = None
        self._task: asyncio.Task[None] | None = None
        self.joined: set[str] = set()  # identities of peers added through etcd

    def start(self, ports: dict[str, Any]) -> None:
        from pddlink.membership.registrar import Registrar
        from pddlink.membership.watcher import MembershipWatcher

        etcd, keys = self.cfg.etcd_config(), self.cfg.keys()
        self.registrar = Registrar(etcd, keys, own_record(self.sidecar, ports), self.cfg.registrar_config())
        self.registrar.start()
        if Role(self.sidecar.cfg.role) in (Role.P, Role.RLD):
            self.watcher = MembershipWatcher(etcd, keys)
            changes = self.watcher.changes()
            self.watcher.start()
            self._task = asyncio.get_running_loop().create_task(self._follow(changes))

    async def draining(self, timeout_s: float = 2.0) -> None:
        """Announce ``draining`` (routers place nothing new here); etcd away: carry on without."""
        from pddlink.errors import DeadlineExceeded
        from pddlink.membership import MemberState

        if self.registrar is not None:
            with contextlib.suppress(DeadlineExceeded):
                await self.registrar.set_state(MemberState.DRAINING, timeout_s=timeout_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.watcher is not None:
            await self.watcher.close()
        if self.registrar is not None:
            await self.registrar.close(revoke=True)

    def status(self) -> dict[str, Any]:
        reg = self.registrar
        return {
            "etcd": self.cfg.etcd,
            "registered": bool(reg and reg.registered),
            "errors": reg.error_count if reg else 0,
            "last_error": reg.last_error if reg else "",
            "peers_joined": sorted(self.joined),
        }

    async def _follow(self, changes: Any) -> None:
        async for change in changes:
            self.apply(change)

    def apply(self, change: MembershipChange) -> None:
        record = change.new if isinstance(change, MemberChanged) else change.record
        if not isinstance(change, (MemberAdded, MemberChanged)) or record.wire_version != WIRE_VERSION:
            return
        if record.identity != f"{record.role.value}/{record.name}" or not record.addresses.kv:
            return
        a = record.addresses
        moved = isinstance(change, MemberChanged) and change.old.addresses != a
        moved = moved and record.identity in self.joined  # the file's peers stay where the file says
        if self.sidecar.add_peer(PeerIdentity.parse(record.identity), a.grpc, a.kv, moved=moved):
            self.joined.add(record.identity)
            log.warning("membership: peer %s at %s joined", record.identity, record.addresses.grpc)
