"""What differs between the kinds of engine behind the router, behind one interface.

The router (``router.Router``) decides per request (``pddlink.routing``) and runs each request
through ``pddlink.lifecycle.RequestRun`` (``router.run.RunDriver``); neither knows which engine
serves the roles. An ``EngineBackend`` supplies the rest:

- ``legs(cluster, deadline)``: a ``Legs`` for one run, turning the machine's commands into calls on
  the roles and posting what they answer to ``inbox`` as lifecycle events;
- ``matched_tokens(prompt)``: how much of the prompt MD is known to hold (the router's DRC view);
- ``usable(role)``: whether a role may get traffic now;
- ``start``/``close``/``status``: the backend's own connections and what it reports.

Two implementations: ``GrpcBackend`` (the reference engine's sidecars over gRPC, ``router.legs``)
and ``router.vllm_legs.VllmBackend`` (vLLM's OpenAI servers over HTTP, each beside its pddlink
vLLM sidecar). ``make_backend(cfg)`` picks by ``RouterConfig.engine``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from pddlink.lifecycle import RunCommand, RunEvent
from pddlink.routing import LinkModel
from pddlink.serving.backlog import POLL_INTERVAL_S, follow_backlog
from pddlink.serving.grpc_tls import open_channel
from pddlink.serving.pb import pb2, pb2_grpc
from pddlink.transport import PeerIdentity, TlsConfig
from router.config import RouterConfig
from router.legs import Cluster, LegCalls
from router.mirror import MirrorFollower
from router.role_health import RoleHealth

__all__ = ["EngineBackend", "GrpcBackend", "Legs", "make_backend"]


class Legs(Protocol):
    """One run's calls on the roles."""

    inbox: asyncio.Queue[RunEvent]

    def execute(self, cmd: RunCommand) -> None: ...

    async def close(self, *, finished: bool) -> None: ...


class EngineBackend(Protocol):
    # whether MD's silence on a request it owes tokens means a stall (``pddlink.lifecycle.stall``)
    md_stall_detection: bool

    def legs(self, cluster: Cluster, deadline: float) -> Legs: ...

    def matched_tokens(self, prompt: tuple[int, ...]) -> int: ...

    def usable(self, role: str) -> bool: ...

    async def start(self, link: LinkModel) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


class GrpcBackend:
    """The reference engine's sidecars: gRPC channels (mutual TLS when configured), their health,
    the DRC mirror that follows MD and P's reported WAN backlog."""

    md_stall_detection = True  # MD's sidecar says when it holds the KV: from then on tokens are due

    def __init__(self, cfg: RouterConfig, tls: TlsConfig | None) -> None:
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        self.health = RoleHealth(("p", "rld", "md"))  # which roles may get traffic (router.role_health)
        self.channels = {
            role: open_channel(
                addr,
                tls,
                PeerIdentity.parse(ident),
                opts,
                interceptors=self.health.interceptors(role.value),
            )
            for role, addr, ident in cfg.sidecars()
        }
        by_role = {role.value: pb2_grpc.SidecarStub(ch) for role, ch in self.channels.items()}
        self.p, self.rld, self.md = by_role["p"], by_role["rld"], by_role["md"]
        self.health.watch({role.value: ch for role, ch in self.channels.items()})
        self.drc = MirrorFollower(self.md)
        self._tasks: list[asyncio.Task[None]] = []

    def legs(self, cluster: Cluster, deadline: float) -> Legs:
        return LegCalls(cluster, self, deadline)

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        return self.drc.matched_tokens(prompt)

    def usable(self, role: str) -> bool:
        return self.health.usable(role)

    async def start(self, link: LinkModel) -> None:
        loop = asyncio.get_running_loop()
        self.health.start()
        self._tasks = [
            loop.create_task(self.drc.follow()),
            loop.create_task(follow_backlog(self.p, pb2.StatusRequest(), link, POLL_INTERVAL_S)),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.health.close()
        for ch in self.channels.values():
            await ch.close(None)

    def status(self) -> dict[str, Any]:
        mirror = self.drc.mirror
        st = mirror.staleness(time.monotonic())
        return {
            "engine": "reference",
            "roles": self.health.status(),
            "drc_mirror": {
                "blocks": len(mirror),
                "epoch": st.epoch,
                "applied_seq": st.applied_seq,
                "seq_lag": st.seq_lag,
                "needs_resync": st.needs_resync,
                "last_error": self.drc.last_error,
            },
        }


def make_backend(cfg: RouterConfig, tls: TlsConfig | None) -> EngineBackend:
    if cfg.engine == "vllm":
        from router.vllm_legs import VllmBackend  # httpx only where vLLM is fronted

        return VllmBackend(cfg)
    return GrpcBackend(cfg, tls)
