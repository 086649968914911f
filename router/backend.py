"""What differs between the kinds of engine behind the router, behind one interface.

The router (``router.Router``) decides per request (``pddlink.routing``) and runs each request
through ``pddlink.lifecycle.RequestRun`` (``router.run.RunDriver``); neither knows which engine
serves the roles. An ``EngineBackend`` supplies the rest:

- ``fleet``: the topology's instances, their health and mirrors; ``fleet.place(prompt, now)`` says
  where a request goes (``router.fleet.Route``);
- ``legs(cluster, deadline, route)``: one run's ``router.leg_driver.LegDriver`` on ``route``, turning
  the machine's commands into the engine's calls on the roles (``RoleCalls``) and posting what they
  answer to ``inbox`` as lifecycle events;
- ``matched_tokens(prompt)``: how much of the prompt an MD is known to hold (the router's DRC view);
- ``usable(role)``: whether a role may get traffic now;
- ``start``/``close``/``status``: the backend's own connections and what it reports.

Two implementations: ``GrpcBackend`` (the reference engine's sidecars over gRPC, ``router.legs``)
and ``router.vllm_backend.VllmBackend`` (vLLM's OpenAI servers over HTTP, each beside its pddlink
vLLM sidecar, ``router.vllm_legs``); both drive their runs with the one ``LegDriver``.
``make_backend(cfg)`` picks by ``RouterConfig.engine``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from pddlink.roles import Role
from pddlink.routing import LinkModel
from pddlink.serving.backlog import watch_backlog
from pddlink.serving.grpc_tls import open_channel
from pddlink.serving.pb import pb2, pb2_grpc
from pddlink.topology import Member
from pddlink.transport import PeerIdentity, TlsConfig
from router.config import RouterConfig
from router.fleet import Fleet, Route
from router.leg_driver import Cluster, LegDriver, RoleCalls
from router.legs import GrpcCalls, RouteStubs, grpc_legs
from router.members import MembershipFollower
from router.mirror import MirrorFollower
from router.role_health import RoleHealth

__all__ = ["EngineBackend", "GrpcBackend", "make_backend"]


class EngineBackend(Protocol):
    # whether MD's silence on a request it owes tokens means a stall (``pddlink.lifecycle.stall``)
    md_stall_detection: bool

    fleet: Fleet  # the instances and where each request goes (``router.fleet``)

    def legs(self, cluster: Cluster, deadline: float, route: Route) -> LegDriver: ...

    def retarget(self, calls: RoleCalls, route: Route) -> None:
        """A run moved within a role: ``calls`` (made by ``legs``) go to ``route``'s instances from
        now on; the calls already under way keep theirs."""
        ...

    def matched_tokens(self, prompt: tuple[int, ...]) -> int: ...

    def usable(self, role: str) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


class GrpcBackend:
    """The reference engine's sidecars: a gRPC channel per instance of the topology (mutual TLS
    with each instance's identity checked when configured), each instance's health, a DRC mirror
    per MD instance from that instance's own events (``router.fleet.Fleet`` places over them) and,
    with one P, P's reported WAN backlog."""

    md_stall_detection = True  # MD's sidecar says when it holds the KV: from then on tokens are due

    def __init__(self, cfg: RouterConfig, tls: TlsConfig | None) -> None:
        self.tls, self.deadline_s = tls, cfg.deadline_s
        topo = cfg.deployment()
        self.pools = cfg.topology is not None  # requests name their MD and RLD to P and RLD
        members = topo.members()
        self.health = RoleHealth([m.name for m in members])  # which instances may get traffic
        # one P: a Prefill waits for it to be back (nothing else could take it); a pool: it fails
        # at once and the request is placed on another P (``Router.replacement``)
        self.lone_p = len(topo.members(Role.P)) == 1
        self.channels = {m.name: self._channel(m) for m in members}
        self.stubs = {name: pb2_grpc.SidecarStub(ch) for name, ch in self.channels.items()}
        self.health.watch(self.channels)
        self.mirrors = {m.name: MirrorFollower(self.stubs[m.name]) for m in topo.members(Role.MD)}
        # each P's own prefix cache (reference P publishes it too): placement prefers the P holding a prompt
        self.p_mirrors = {m.name: MirrorFollower(self.stubs[m.name]) for m in topo.members(Role.P)}
        self.fleet = Fleet(
            topo,
            policy=cfg.placement_policy,
            usable=self.health.usable,
            mirrors=self.mirrors,
            p_mirrors=self.p_mirrors,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            wan_links=cfg.wan_links,
            p_prefill_tokens_per_s=cfg.p_prefill_tokens_per_s,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._followers: dict[str, asyncio.Task[None]] = {}  # mirrors of MDs that joined at run time
        self.fleet.router_name = cfg.name  # the prefix of the request keys it mints
        self.membership = MembershipFollower(self, cfg.membership) if cfg.membership.enabled else None

    def _channel(self, m: Member) -> Any:
        """The channel to ``m``: mutual TLS checks the certificate names ``m``'s identity."""
        return open_channel(
            m.instance.address,
            self.tls,
            PeerIdentity.parse(m.instance.identity),
            [("grpc.max_receive_message_length", 64 << 20)],
            interceptors=self.health.interceptors(m.name, m.role.value, wait_for_p=self.lone_p),
        )

    # -- membership that changes at run time (``router.members``) --------------------------------

    def add_instance(self, m: Member) -> None:
        """``m`` joins: a channel of its own (its identity checked by mTLS on connect), its health
        followed, for an MD or a P its own DRC mirror; then placement may choose it."""
        channel = self._channel(m)  # lazy: nothing is dialled yet
        stub = pb2_grpc.SidecarStub(channel)
        mirror = MirrorFollower(stub) if m.role in (Role.MD, Role.P) else None
        loop = asyncio.get_running_loop()
        try:
            self.fleet.add(m.instance, m.datacenter, mirror)  # InvalidInput: the topology cannot hold it
        except BaseException:
            self._tasks.append(loop.create_task(_close_later(channel, 0.0)))
            raise
        self.channels[m.name], self.stubs[m.name] = channel, stub
        self.health.add(m.name, channel)
        if mirror is not None:
            (self.p_mirrors if m.role is Role.P else self.mirrors)[m.name] = mirror
            self._followers[m.name] = loop.create_task(mirror.follow())

    async def remove_instance(self, name: str) -> None:
        """``name`` left: out of placement at once; its channel closes once what runs there has
        had its deadline (a request placed there ends on its own)."""
        self.fleet.remove(name, time.monotonic())
        self.mirrors.pop(name, None)
        self.p_mirrors.pop(name, None)
        follower = self._followers.pop(name, None)
        if follower is not None:
            follower.cancel()
        await self.health.remove(name)
        channel = self.channels.pop(name, None)
        self.stubs.pop(name, None)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(_close_later(channel, self.deadline_s))
            self._tasks.append(task)

    def legs(self, cluster: Cluster, deadline: float, route: Route) -> LegDriver:
        return grpc_legs(cluster, self.route_stubs(route), deadline)

    def retarget(self, calls: RoleCalls, route: Route) -> None:
        assert isinstance(calls, GrpcCalls)
        calls.retarget(self.route_stubs(route))

    def route_stubs(self, route: Route) -> RouteStubs:
        rld = route.rld
        return RouteStubs(
            p=self.stubs[route.p.name],
            md=self.stubs[route.md.name],
            rld=self.stubs[rld.name] if rld is not None else None,
            md_identity=route.md.instance.identity if self.pools else "",
            rld_identity=rld.instance.identity if self.pools and rld is not None else "",
        )

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        """The most any MD is known to hold of ``prompt``."""
        return max((m.matched_tokens(prompt) for m in self.mirrors.values()), default=0)

    def usable(self, role: str) -> bool:
        """A role (any of its instances) or one instance by name."""
        names = [m.name for m in self.fleet.members.values() if m.role.value == role] or [role]
        return any(self.health.usable(n) for n in names)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.health.start()
        followed = [*self.mirrors.values(), *self.p_mirrors.values()]
        self._tasks = [loop.create_task(m.follow()) for m in followed]
        topo = self.fleet.topology
        ps, links = topo.members(Role.P), topo.links
        behind: list[tuple[LinkModel, set[str] | None]]
        if len(ps) == 1 and len(links) == 1:  # P's backlog is toward its one MD datacenter
            behind = [(self.fleet.links[frozenset((links[0].a, links[0].b))], None)]
        else:  # each link hears what every P has queued toward the MDs behind it
            behind = [
                (self.fleet.links[frozenset((k.a, k.b))], {m.instance.identity for m in topo.members(Role.MD)
                                                          if m.datacenter in (k.a, k.b)})
                for k in links
            ]  # fmt: skip
        names = [p.name for p in ps]

        def pending(k: int, keys: frozenset[str]) -> None:
            self.fleet.reported_pending[names[k]] = keys

        stubs = [self.stubs[name] for name in names]
        follow = watch_backlog(stubs, pb2.StatusRequest(), behind, pending)
        self._tasks.append(loop.create_task(follow))
        if self.membership is not None:
            self.membership.start()

    async def close(self) -> None:
        if self.membership is not None:
            await self.membership.close()
        tasks = self._tasks + list(self._followers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.health.close()
        for ch in self.channels.values():
            await ch.close(None)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        health = self.health.status()
        out: dict[str, Any] = {"engine": "reference", "topology": self.fleet.status(now, health)}
        if not self.pools:  # the single-instance document, as before
            by_role = {m.role.value: m.name for m in self.fleet.members.values()}
            out["roles"] = {role: health[name] for role, name in by_role.items()}
            out["drc_mirror"] = self.mirrors[by_role["md"]].status(now)
            out["p_mirror"] = self.p_mirrors[by_role["p"]].status(now)
        else:
            out["drc_mirrors"] = {name: m.status(now) for name, m in self.mirrors.items()}
            out["p_mirrors"] = {name: m.status(now) for name, m in self.p_mirrors.items()}
        if self.membership is not None:
            out["membership"] = self.membership.status()
        return out


async def _close_later(channel: Any, after_s: float) -> None:
    await asyncio.sleep(after_s)
    await channel.close(None)


def make_backend(cfg: RouterConfig, tls: TlsConfig | None) -> EngineBackend:
    if cfg.engine == "vllm":
        from router.vllm_backend import VllmBackend  # httpx only where vLLM is fronted

        return VllmBackend(cfg)
    return GrpcBackend(cfg, tls)
