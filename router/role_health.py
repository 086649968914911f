"""The router's view of each role (P, RLD, MD), or of each instance of a topology's pools (keys
are then instance names): may it send that one traffic now?

One watcher per gRPC channel follows the channel's connectivity state: a channel that leaves READY
(the role was killed, its socket reset, its host went away) makes the role unusable at once, not
after the next request ends. The watcher then asks the channel to reconnect (the channels reconnect
within ``pddlink.serving.grpc_tls.RECONNECT_OPTIONS``' backoff, so a restarted role is found within about a
second), and the role is usable again only after the channel is READY *and* a ``Status`` call has
answered (the process serves, not merely accepts). While READY a ``Status`` probe runs every
``probe_every_s``: a role that hangs (its socket open) leaves the pool when the probe times out.

The channels' interceptors (``interceptors(role)``) add two things the router's runs need without
knowing about them: an Attach refused for capacity marks the role full for ``FULL_COOL_S`` before
the caller sees the error (its fallback then avoids the role), and P's Prefill waits for the
channel to be READY within its timeout (no request is sent to a P that is not back yet).

Before the first loss a role counts as usable (a router starting next to its sidecars sends at once,
as before). The router asks ``usable(role)``; ``status()`` feeds its ``/status``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from pddlink.serving.rpc import stubs

PROBE_TIMEOUT_S = 1.0
PROBE_EVERY_S = 2.0
WATCH_TICK_S = 0.5  # the longest a watcher waits on a state change before it looks again
FULL_COOL_S = 1.0  # a role that refused an Attach for capacity gets no new request this long
ATTACH = "/pddlink.v1.Sidecar/Attach"
PREFILL = "/pddlink.v1.Sidecar/Prefill"


@dataclass
class RoleState:
    usable: bool = True  # unknown counts as usable until the first loss
    state: str = "IDLE"
    losses: int = 0
    since: float = 0.0  # monotonic time of the last change of ``usable``
    last_error: str = ""
    full_until: float = 0.0  # refused an Attach for capacity: no new requests before then
    capacity_refusals: int = 0


class RoleHealth:
    """Watches ``channels`` (role -> channel); see the module docstring."""

    def __init__(
        self,
        roles: Sequence[str],
        *,
        probe_every_s: float = PROBE_EVERY_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.roles = {role: RoleState(since=time.monotonic()) for role in roles}
        self.probe_every_s, self.probe_timeout_s = probe_every_s, probe_timeout_s
        self.channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._joined: dict[str, asyncio.Task[None]] = {}  # channels added at run time (``add``)

    def interceptors(
        self, key: str, role: str = "", *, wait_for_p: bool = True
    ) -> list[grpc.aio.ClientInterceptor]:
        """For ``key``'s channel (a role, or an instance of ``role``): notes an Attach refused for
        capacity (``CapacityWatch``); on P's (``wait_for_p``), a Prefill waits for the channel to
        be READY within its timeout (``WaitForReady``)."""
        out: list[Any] = [CapacityWatch(self, key)]
        if (role or key) == "p" and wait_for_p:
            out.append(WaitForReady(frozenset({PREFILL})))
        return out

    def watch(self, channels: Mapping[str, grpc.aio.Channel]) -> None:
        """The channels to follow (made with ``interceptors(role)``); ``start`` begins."""
        pb2, pb2_grpc = stubs()
        self._request = pb2.StatusRequest()
        self.channels = dict(channels)
        self._stubs = {role: pb2_grpc.SidecarStub(ch) for role, ch in channels.items()}

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch(role)) for role in self.channels]

    async def close(self) -> None:
        tasks = self._tasks + list(self._joined.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._joined = [], {}

    def add(self, key: str, channel: grpc.aio.Channel) -> None:
        """A channel that joins at run time (membership), followed from now on. Unlike the
        topology file's, it is not usable until its channel is READY (with TLS: the handshake
        proved the identity its record named) and it answered a Status probe."""
        _, pb2_grpc = stubs()
        self.roles[key] = RoleState(usable=False, state="JOINING", since=time.monotonic())
        self.channels[key] = channel
        self._stubs[key] = pb2_grpc.SidecarStub(channel)
        self._joined[key] = asyncio.get_running_loop().create_task(self._watch(key))

    async def remove(self, key: str) -> None:
        """``key`` left: no more watching; ``usable`` answers False for it from now on."""
        task = self._joined.pop(key, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.channels.pop(key, None)
        self._stubs.pop(key, None)
        st = self.roles.get(key)
        if st is not None:
            self._set(key, False, "left the membership")

    def usable(self, role: str) -> bool:
        st = self.roles.get(role)
        return st is None or (st.usable and time.monotonic() >= st.full_until)

    def full(self, role: str) -> None:
        """``role`` refused an Attach for capacity: send it no new request for ``FULL_COOL_S``."""
        st = self.roles[role]
        st.full_until = time.monotonic() + FULL_COOL_S
        st.capacity_refusals += 1

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            role: {
                "usable": st.usable,
                "channel": st.state,
                "losses": st.losses,
                "for_s": round(now - st.since, 3),
                "last_error": st.last_error,
                "full_for_s": round(max(0.0, st.full_until - now), 3),
                "capacity_refusals": st.capacity_refusals,
            }
            for role, st in self.roles.items()
        }

    def _set(self, role: str, usable: bool, error: str = "") -> None:
        st = self.roles[role]
        if error:
            st.last_error = error
        if st.usable != usable:
            st.usable, st.since = usable, time.monotonic()
            if not usable:
                st.losses += 1

    async def _probe(self, role: str) -> bool:
        try:
            await self._stubs[role].Status(self._request, timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return True  # it serves; who may call Status is its own business
            self._set(role, False, f"status probe: {exc.code().name}: {exc.details()}")
            return False
        self._set(role, True)
        return True

    async def _watch(self, role: str) -> None:
        channel = self.channels[role]
        st = self.roles[role]
        ready_seen = False
        next_probe = 0.0
        # ``wait_for_state_change`` has no deadline: each call is a watch in gRPC's core that lives
        # until the state changes. So one watch at a time, awaited across ticks and never cancelled
        # by a tick (a cancelled one stays registered: two a second per role on a READY channel).
        change: asyncio.Future[None] | None = None
        while True:
            state = channel.get_state(try_to_connect=True)
            st.state = state.name
            if state is grpc.ChannelConnectivity.READY:
                ready_seen = True
                now = time.monotonic()
                if not st.usable or now >= next_probe:  # back, or due: does it serve?
                    await self._probe(role)
                    next_probe = time.monotonic() + self.probe_every_s
            elif ready_seen or state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                self._set(role, False, f"channel {state.name}")  # lost: no traffic until probed
            if change is None or change.done():
                if change is not None and not change.cancelled():
                    change.exception()  # retrieved (a closed channel's watch may fail)
                change = asyncio.ensure_future(channel.wait_for_state_change(state))
            try:
                await asyncio.wait({change}, timeout=WATCH_TICK_S)
            except asyncio.CancelledError:
                change.cancel()
                raise


if TYPE_CHECKING:  # generic in the type stubs only
    _StreamInterceptor = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _UnaryInterceptor = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
else:
    _StreamInterceptor = grpc.aio.UnaryStreamClientInterceptor
    _UnaryInterceptor = grpc.aio.UnaryUnaryClientInterceptor


def _method(details: Any) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


class WaitForReady(_UnaryInterceptor):
    """``methods`` wait for the channel to be READY (within their own timeout) instead of failing
    at once while the role restarts: P has no stand-in, and a request sent while it is down would
    fail with ``failed to connect to all addresses``; it now goes out once P is back, or ends with
    ``DEADLINE_EXCEEDED`` at its deadline."""

    def __init__(self, methods: frozenset[str]) -> None:
        self.methods = methods

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: Any,
        request: Any,
    ) -> Any:
        if _method(client_call_details) in self.methods:
            client_call_details = client_call_details._replace(wait_for_ready=True)
        return await continuation(client_call_details, request)


class CapacityWatch(_StreamInterceptor):
    """Reads how each Attach stream on a role's channel ends: ``RESOURCE_EXHAUSTED`` with details
    ``capacity: ...`` (``sidecar.kv_admission``) marks the role full before the caller sees the
    error, so the caller's fallback (and the next requests) already avoid it."""

    def __init__(self, health: RoleHealth, role: str) -> None:
        self.health, self.role = health, role

    async def intercept_unary_stream(  # type: ignore[override]
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: Any,
        request: Any,
    ) -> Any:
        call = await continuation(client_call_details, request)
        if _method(client_call_details) != ATTACH:
            return call
        return self._watched(call)

    async def _watched(self, call: Any) -> AsyncIterator[Any]:
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and (exc.details() or "").startswith(
                "capacity:"
            ):
                self.health.full(self.role)
            raise
        finally:
            if not call.done():
                call.cancel()  # the caller stopped reading: end the RPC as it would have
