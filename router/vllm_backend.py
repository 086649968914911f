"""``VllmBackend`` is the router's ``EngineBackend`` for vLLM: one HTTP client over the deployment's
vLLM instances (``RouterConfig.deployment()``: a ``[topology]`` of vLLM pools, or ``[vllm]``'s
servers as a topology of one each), each instance's health, and the DRC view: a mirror per MD
instance of that instance's prefix cache, fed by its own vLLM's KV-cache events
(``router.mirror.VllmMirror`` on the instance's ``kv_events``; ``[vllm] md_kv_events`` in the old
form; without one the router knows of no prefix on that MD). ``router.fleet.Fleet`` places each
request over them; its legs go to the route's servers (``router.vllm_legs``).

Health: every instance's ``/health`` is polled each ``HEALTH_INTERVAL_S`` (all at once); one that
does not answer 200 is out of placement at once (``Fleet`` logs and counts it), and back when it
answers again. An MD found dead empties its mirror (a restarted vLLM holds nothing; the mirror
refills from the new process's events). With pools, P is told which MD (and RLD) each transfer
goes to (``pools``: the instance's name in the request's ``kv_transfer_params``; P's sidecar knows
the same topology).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pddlink.roles import Role
from pddlink.routing import RoutingPolicy
from router.config import RouterConfig, VllmEngineConfig
from router.fleet import Fleet, Route
from router.leg_driver import Cluster, LegDriver, RoleCalls
from router.mirror import VllmMirror
from router.vllm_legs import VllmCalls, vllm_legs

HEALTH_INTERVAL_S = 1.0


@dataclass
class InstanceHealth:
    """What the last ``/health`` poll of one instance said (unknown counts as usable)."""

    url: str
    usable: bool = True
    error: str = ""
    losses: int = 0
    since: float = 0.0  # monotonic time of the last change of ``usable``

    def set(self, ok: bool, error: str, now: float) -> None:
        self.error = error
        if ok != self.usable:
            self.usable, self.since = ok, now
            self.losses += not ok

    def status(self, now: float) -> dict[str, Any]:
        return {
            "url": self.url,
            "usable": self.usable,
            "error": self.error,
            "losses": self.losses,
            "for_s": round(now - self.since, 3),
        }


class MdView:
    """One MD instance's mirror as ``router.fleet`` reads it: nothing while the MD is out."""

    def __init__(self, backend: VllmBackend, name: str) -> None:
        self.backend, self.name = backend, name

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        m = self.backend.mirrors.get(self.name)
        if m is None or not self.backend.usable(self.name):
            return 0
        return m.matched_tokens(prompt)

    def blocks(self) -> int:
        m = self.backend.mirrors.get(self.name)
        return 0 if m is None else len(m.index)

    def block_tokens(self) -> int | None:
        m = self.backend.mirrors.get(self.name)
        return m.block_size if m is not None and m.learnt else None


class VllmBackend:
    """``router.backend.EngineBackend`` for vLLM servers (``RouterConfig.vllm``, ``topology``)."""

    # vLLM's MD parks a request until its KV has crossed the WAN and says nothing meanwhile (P's
    # answer comes when P prefilled, not when MD holds the KV): a token-silence bound would cut
    # healthy requests (measured: md_stalled after 2 s on every relayed request, no handoff left).
    # MD's death shows as its HTTP stream breaking; the deadline bounds the rest.
    md_stall_detection = False

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.v: VllmEngineConfig = cfg.vllm
        self.http = httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=512), headers=self.v.api_headers()
        )
        topo = cfg.deployment()
        self.pools = cfg.topology is not None  # P is told the MD (and RLD) of each transfer
        now = time.monotonic()
        self.health = {m.name: InstanceHealth(m.instance.api_url, since=now) for m in topo.members()}
        self.mirrors = {m.name: VllmMirror() for m in topo.members(Role.MD) if m.instance.kv_events}
        self.policy = RoutingPolicy(rld_max_load=cfg.rld_max_load)
        self._health: asyncio.Task[None] | None = None
        self.fleet = Fleet(
            topo,
            policy=cfg.placement_policy,
            usable=self.usable,
            mirrors={m.name: MdView(self, m.name) for m in topo.members(Role.MD)},
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            wan_links=cfg.wan_links,
            p_prefill_tokens_per_s=cfg.p_prefill_tokens_per_s,
        )
        self.fleet.router_name = cfg.name

    def legs(self, cluster: Cluster, deadline: float, route: Route) -> LegDriver:
        return vllm_legs(cluster, self, deadline, route)

    def retarget(self, calls: RoleCalls, route: Route) -> None:
        assert isinstance(calls, VllmCalls)
        calls.retarget(route)

    def first_route(self) -> Route:
        """The first P, MD and RLD of the topology (the route of a topology of one each)."""
        topo = self.fleet.topology
        rld = topo.members(Role.RLD)
        return self.fleet.route_of(
            topo.members(Role.P)[0].name, topo.members(Role.MD)[0].name, rld[0].name if rld else None
        )

    @property
    def mirror(self) -> VllmMirror | None:
        """The mirror of the one MD of a topology of one each (None with pools or no events)."""
        mds = self.fleet.topology.members(Role.MD)
        return self.mirrors.get(mds[0].name) if len(mds) == 1 else None

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        """The most any usable MD is known to hold of ``prompt`` (the router's view only: P's
        sidecar still reserves against that MD's own DRC before it ships, so a stale view costs a
        choice, never a wrong transfer)."""
        return max((v.matched_tokens(prompt) for v in self.fleet.mirrors.values()), default=0)

    def usable(self, role: str) -> bool:
        """One instance by name, or a role (any of its instances)."""
        h = self.health.get(role)
        if h is not None:
            return h.usable
        names = [m.name for m in self.fleet.members.values() if m.role.value == role]
        return any(self.health[n].usable for n in names)

    def rld_load(self, rld_active: int) -> float:
        return rld_active / self.cfg.rld_capacity

    def problems(self) -> list[str]:
        """Why a mirror cannot be trusted now (no KV-event publisher at its endpoint), per MD."""
        many = len(self.mirrors) > 1
        return [f"{name}: {p}" if many else p for name, m in self.mirrors.items() if (p := m.problem())]

    async def start(self) -> None:
        for name, mirror in self.mirrors.items():
            mirror.start(self.fleet.members[name].instance.kv_events, name)
        self._health = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(name) for name in self.health))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _probe(self, name: str) -> None:
        h = self.health[name]
        try:
            r = await self.http.get(h.url + "/health", timeout=HEALTH_INTERVAL_S)
            ok, err = r.status_code == 200, "" if r.status_code == 200 else f"health {r.status_code}"
        except httpx.HTTPError as exc:
            ok, err = False, type(exc).__name__
        mirror = self.mirrors.get(name)
        if not ok and mirror is not None:
            mirror.forget_all()  # a restarted MD holds nothing: never claim its old blocks
        h.set(ok, err, time.monotonic())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        for mirror in self.mirrors.values():
            await mirror.close()
        await self.http.aclose()

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        health = {name: h.status(now) for name, h in self.health.items()}
        out: dict[str, Any] = {
            "engine": "vllm",
            "model": self.v.model,
            "topology": self.fleet.status(now, health),
        }
        if not self.pools:  # the single-instance document, as before
            by_role = {m.role.value: m.name for m in self.fleet.members.values()}
            out["roles"] = {role: health[name] for role, name in by_role.items()}
            mirror = self.mirror
            out["drc_mirror"] = mirror.status() if mirror is not None else {"source": "none"}
        else:
            out["drc_mirrors"] = {
                m.name: self.mirrors[m.name].status() if m.name in self.mirrors else {"source": "none"}
                for m in self.fleet.topology.members(Role.MD)
            }
        return out
