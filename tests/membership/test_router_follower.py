"""The router's side of membership (``router.members.MembershipFollower``) over a real
``GrpcBackend`` (lazy channels, nothing listening), the changes fed in directly: a member the file
does not name joins (a channel, a health watch, a mirror) but is not usable before its channel
proves it; one that leaves is out at once; the file's members stay, drained while their record
says draining, and an operator's drain is not undone by etcd; records this router cannot serve are
refused by name."""

from __future__ import annotations

import asyncio
import dataclasses

from pddlink.membership import (
    MemberAdded,
    MemberAddresses,
    MemberChanged,
    MemberRecord,
    MemberRemoved,
    MemberState,
)
from pddlink.membership.config import MembershipConfig
from pddlink.roles import Role
from pddlink.topology import parse_topology
from pddlink.wire import WIRE_VERSION
from router.backend import GrpcBackend
from router.config import RouterConfig
from router.members import MembershipFollower
from tests.membership.test_fleet_changes import TOPOLOGY


def _record(name: str, port: int, **kw: object) -> MemberRecord:
    a = MemberAddresses(grpc=f"127.0.0.1:{port}", kv=f"127.0.0.1:{port + 1}")
    fields: dict[str, object] = dict(
        role=Role.MD, datacenter="dc-b", name=name, addresses=a, identity=f"md/{name}",
        engine="reference", wire_version=WIRE_VERSION,
    )  # fmt: skip
    fields.update(kw)
    return MemberRecord(**fields)  # type: ignore[arg-type]


async def _scenario() -> None:
    backend = GrpcBackend(RouterConfig(topology=parse_topology(TOPOLOGY)), None)
    follower = MembershipFollower(backend, MembershipConfig(etcd="127.0.0.1:1"))
    fleet = backend.fleet
    try:
        b1 = _record("md-b1", 40001)
        await follower.apply(MemberAdded(b1))
        assert "md-b1" in fleet.members and "md-b1" in backend.mirrors
        assert not fleet.in_placement("md-b1", 0.0)  # not before its channel is READY and it answered
        assert fleet.why_out("md-b1", 0.0) == "unreachable"
        await follower.apply(MemberRemoved(b1))
        assert "md-b1" not in fleet.members and "md-b1" not in backend.channels
        assert follower.joined == set()

        b0 = _record("md-b0", 40010, state=MemberState.DRAINING)  # the file's own md-b0
        await follower.apply(MemberAdded(b0))
        assert fleet.why_out("md-b0", 0.0) == "drained"
        await follower.apply(MemberChanged(b0, dataclasses.replace(b0, state=MemberState.SERVING)))
        assert fleet.why_out("md-b0", 0.0) == ""
        fleet.drain("md-b0", 0.0)  # an operator's drain
        await follower.apply(MemberChanged(b0, dataclasses.replace(b0, engine="reference")))
        assert fleet.why_out("md-b0", 0.0) == "drained"

        await follower.apply(MemberAdded(_record("md-old", 40020, wire_version=WIRE_VERSION - 1)))
        await follower.apply(MemberAdded(_record("md-far", 40030, datacenter="dc-z")))
        await follower.apply(MemberAdded(_record("md-vl", 40040, engine="vllm")))
        assert set(follower.refused) == {"md/md-old", "md/md-far", "md/md-vl"}
        assert "wire version" in follower.refused["md/md-old"]
        assert "dc-z" in follower.refused["md/md-far"]
        assert {"md-old", "md-far", "md-vl"}.isdisjoint(fleet.members)
    finally:
        await backend.close()


def test_the_router_follows_membership_changes() -> None:
    asyncio.run(_scenario())
