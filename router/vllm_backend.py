"""``VllmBackend`` is the router's ``EngineBackend`` for vLLM: one HTTP client, the roles' health (each
server's ``/health`` polled; a dead one is avoided until it answers again), and the DRC view: a
mirror of MD's prefix cache fed by MD vLLM's own KV-cache events (``router.mirror.VllmMirror``,
``[vllm] md_kv_events``; without it the router knows of no prefix on MD). MD found dead empties it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from pddlink.roles import Role
from pddlink.routing import RoutingPolicy
from pddlink.topology import Engine, topology_from_addresses
from router.config import RouterConfig, VllmEngineConfig
from router.fleet import Fleet, Route
from router.leg_driver import Cluster, LegDriver
from router.mirror import VllmMirror
from router.vllm_legs import vllm_legs

HEALTH_INTERVAL_S = 1.0


class _Matched:
    """MD's vLLM mirror as ``router.fleet`` reads it."""

    def __init__(self, backend: VllmBackend) -> None:
        self.backend = backend

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        return self.backend.matched_tokens(prompt)

    def blocks(self) -> int:
        return 0 if self.backend.mirror is None else len(self.backend.mirror.index)

    def block_tokens(self) -> int | None:
        m = self.backend.mirror
        return m.block_size if m is not None and m.learnt else None


class VllmBackend:
    """``router.backend.EngineBackend`` for vLLM servers (``RouterConfig.vllm``)."""

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
        self.urls = {"p": self.v.p_url, "md": self.v.md_url, "rld": self.v.rld_url}
        self.roles: dict[str, dict[str, Any]] = {
            role: {"url": url, "usable": bool(url), "error": "" if url else "not configured"}
            for role, url in self.urls.items()
        }
        self.policy = RoutingPolicy(rld_max_load=cfg.rld_max_load)
        self._health: asyncio.Task[None] | None = None
        self.mirror: VllmMirror | None = VllmMirror() if self.v.md_kv_events else None
        topo = topology_from_addresses(
            "", "", "", line_mbit=cfg.line_mbit, rtt_ms=cfg.rtt_ms, engine=Engine.VLLM,
            p_url=self.v.p_url, rld_url=self.v.rld_url, md_url=self.v.md_url,
        )  # fmt: skip
        self._role_of = {m.name: m.role.value for m in topo.members()}
        self.fleet = Fleet(
            topo,
            policy=cfg.placement_policy,
            usable=self.usable,
            mirrors={m.name: _Matched(self) for m in topo.members(Role.MD)},
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            wan_links=cfg.wan_links,
            p_prefill_tokens_per_s=cfg.p_prefill_tokens_per_s,
        )

    def legs(self, cluster: Cluster, deadline: float, route: Route) -> LegDriver:
        return vllm_legs(cluster, self, deadline)  # one server per role: the route is that one

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        # the router's view only (the policy's choice); P's sidecar still reserves against MD's own
        # DRC before it ships, so a stale view costs a choice, never a wrong transfer
        if self.mirror is None or not self.usable("md"):
            return 0
        return self.mirror.matched_tokens(prompt)

    def usable(self, role: str) -> bool:
        """A role or one instance by name (one server per role here)."""
        return bool(self.roles[self._role_of.get(role, role)]["usable"])

    def rld_load(self, rld_active: int) -> float:
        return rld_active / self.cfg.rld_capacity

    async def start(self) -> None:
        if self.mirror is not None:
            self.mirror.start(self.v.md_kv_events)
        self._health = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            for role, url in self.urls.items():
                if url:
                    await self._probe(role, url)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _probe(self, role: str, url: str) -> None:
        try:
            r = await self.http.get(url + "/health", timeout=HEALTH_INTERVAL_S)
            ok, err = r.status_code == 200, "" if r.status_code == 200 else f"health {r.status_code}"
        except httpx.HTTPError as exc:
            ok, err = False, type(exc).__name__
        if not ok and role == "md" and self.mirror is not None:
            self.mirror.forget_all()  # a restarted MD holds nothing: never claim its old blocks
        self.roles[role].update(usable=ok, error=err)

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self.mirror is not None:
            await self.mirror.close()
        await self.http.aclose()

    def status(self) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "model": self.v.model,
            "roles": {role: dict(st) for role, st in self.roles.items()},
            "drc_mirror": self.mirror.status() if self.mirror is not None else {"source": "none"},
        }
