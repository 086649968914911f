"""A router request's RPCs to the reference engine's sidecars: the calls that
``router.leg_driver.LegDriver`` starts for ``pddlink.lifecycle.RequestRun``'s commands.

``GrpcCalls``' calls post their results to the run's inbox as lifecycle events: the Attach streams
on RLD and MD (``TokenArrived``, then ``StreamEnded``; MD's ``ready``
after a recompute: ``MdReady``), P's Prefill (``PrefillDone`` / ``PrefillFailed``), RLD's
StartHandoff (``HandoffDone``) and the router's own Handoff to MD when RLD is lost
(``TakeoverFailed`` if it fails). Every RPC's timeout is the request's time left. A task that dies
of anything else (a bug, an answer it cannot convert) posts ``LegCrashed`` (``router.leg_tasks``): the
run fails at once with the exception's name instead of waiting for its deadline. ``close``
cancels what is left; P's shipment to MD may linger until its deadline so MD still imports (and
caches) the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import grpc

from pddlink.handoff import HandoffMode, HandoffSlice
from pddlink.lifecycle import (
    HandoffDone,
    HandoffOutcome,
    HandoffResult,
    Leg,
    MdReady,
    PrefillDone,
    PrefillFailed,
    SendPrefill,
    StreamClosed,
    StreamEnd,
    StreamEnded,
    TakeOver,
    TakeoverFailed,
    TokenArrived,
)
from pddlink.lifecycle.stream import PromptReady, StreamClosing
from pddlink.roles import Role
from pddlink.serving.handoff_wire import slice_to_wire
from pddlink.serving.pb import pb2
from pddlink.serving.sampling_pb import sampling_to_pb
from pddlink.serving.stream_pb import WireVersionRefused, answer_from_pb, event_from_pb
from pddlink.wire.frame import WIRE_VERSION
from router.leg_driver import MIN_TIMEOUT_S, Call, Cluster, LegDriver, LegRun
from router.leg_tasks import TaskKind
from router.pb import report_from_pb

MD_IMPORT_GRACE_S = 0.2  # MD imports right after P's transfer; release it after that


@dataclass(frozen=True, slots=True)
class RouteStubs:
    """The sidecars one run talks to (``router.backend.GrpcBackend.route_stubs``): the P, MD and
    RLD its route names, and the identities P and RLD are told to ship and hand over to ("" with
    the old three addresses: each sidecar's one configured peer)."""

    p: Any
    md: Any
    rld: Any | None
    md_identity: str = ""
    rld_identity: str = ""


def grpc_legs(cluster: Cluster, stubs: RouteStubs, deadline: float) -> LegDriver:
    """One run's legs on the reference engine's sidecars ``stubs``."""
    run = LegRun(cluster, deadline)
    return LegDriver(run, GrpcCalls(run, stubs))


class GrpcCalls:
    """``router.leg_driver.RoleCalls`` for the reference engine's sidecars."""

    stream_kinds = frozenset({TaskKind.STREAM})  # not MD's take-over call: MD's stream answers it

    def __init__(self, run: LegRun, stubs: RouteStubs) -> None:
        self.r = run
        self.s = stubs

    def retarget(self, stubs: RouteStubs) -> None:
        """The run moved within a role (``MoveOff``): the calls from here on go to ``stubs``; the
        ones already under way keep theirs."""
        self.s = stubs

    def stream(self, on: Role, leg: Leg) -> tuple[TaskKind, Call] | StreamClosed:
        stub = self.s.rld if on is Role.RLD else self.s.md
        if stub is None:  # no RLD beside this request's P (the machine then ends the stream)
            return StreamClosed(StreamEnd.FAILED, "no_rld_beside_p")
        return TaskKind.STREAM, self._stream(on, stub, leg)

    def prefill(self, cmd: SendPrefill) -> Call:
        return self._prefill(cmd, self.s)

    def start_handoff(self, sid: str) -> Call:
        return self._start_handoff(sid, self.s)

    def take_over(self, cmd: TakeOver) -> Call:
        return self._take_over(cmd, self.s)

    # -- the RPCs ----------------------------------------------------------------------------------

    async def _stream(self, role: Role, stub: Any, leg: Leg) -> None:
        req = pb2.AttachRequest(
            request_id=leg.sid,
            prompt=list(leg.prompt),
            sampling=sampling_to_pb(leg.sampling),
            deadline_s=self.r.left(),
            recompute=pb2.Recompute.ValueType(leg.recompute if role is Role.MD else 0),
            wire_version=WIRE_VERSION,
        )
        closed, mode = StreamClosed(StreamEnd.FAILED, "stream_closed"), None
        try:
            async for pb in stub.Attach(req, timeout=self.r.left()):
                ev = event_from_pb(pb)
                if isinstance(ev, PromptReady):  # MD's recompute is done: it holds the prompt's KV
                    self.r.cluster.on_md_ready(leg.sid, len(leg.prompt) - ev.cached_tokens, ev.recompute_s)
                    await self.r.inbox.put(MdReady(leg.sid, ev.recompute_s, ev.cached_tokens))
                    continue
                if isinstance(ev, StreamClosing):
                    closed, mode = ev.closed, ev.handoff_mode
                    break
                await self.r.inbox.put(TokenArrived(leg.sid, role, ev.position, ev.token_id, ev.last))
        except grpc.aio.AioRpcError as exc:
            closed = StreamClosed(StreamEnd.FAILED, exc.code().name.lower())
        except WireVersionRefused as exc:  # a sidecar of another version: refused, never misread
            closed = StreamClosed(StreamEnd.FAILED, f"wire_version: {exc.message}")
        except asyncio.CancelledError:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await asyncio.wait_for(
                    stub.Release(pb2.ReleaseRequest(request_id=leg.sid, reason="router")), 1.0
                )
            raise
        await self.r.inbox.put(StreamEnded(leg.sid, role, closed, mode))

    async def _prefill(self, cmd: SendPrefill, to: RouteStubs) -> None:
        leg = cmd.leg
        req = pb2.PrefillRequest(
            request_id=leg.sid,
            prompt=list(leg.prompt),
            sampling=sampling_to_pb(leg.sampling),
            ship_to_md=cmd.ship_to_md,
            ship_to_rld=cmd.ship_to_rld,
            first_token_to_md=cmd.first_token_to_md,
            deadline_s=max(self.r.deadline - time.monotonic() - 0.2, MIN_TIMEOUT_S),
            md_identity=to.md_identity,
            rld_identity=to.rld_identity if cmd.ship_to_rld else "",
        )
        try:
            reply = await to.p.Prefill(req, timeout=self.r.left())
            new_tokens = len(leg.prompt) - reply.p_cached_tokens
            self.r.cluster.on_prefilled(leg.sid, new_tokens, reply.prefill_seconds)
            await self.r.inbox.put(PrefillDone(leg.sid, report_from_pb(reply)))
        except grpc.aio.AioRpcError as exc:
            await self.r.inbox.put(PrefillFailed(leg.sid, f"{exc.code().name.lower()}: {exc.details()}"))

    async def _start_handoff(self, sid: str, to: RouteStubs) -> None:
        if to.rld is None:
            await self.r.inbox.put(HandoffDone(sid, HandoffResult(HandoffOutcome.FAILED, "no_rld")))
            return
        try:
            deadline_s = max(self.r.deadline - time.monotonic() - 0.1, MIN_TIMEOUT_S)
            start = pb2.HandoffStart(request_id=sid, deadline_s=deadline_s, md_identity=to.md_identity)
            start.wire_version = WIRE_VERSION
            answer = answer_from_pb(await to.rld.StartHandoff(start, timeout=self.r.left()))
            result, mode = answer.result, answer.mode
        except grpc.aio.AioRpcError as exc:
            result, mode = HandoffResult(HandoffOutcome.FAILED, exc.code().name), None
        except WireVersionRefused as exc:  # an RLD of another version: refused, never misread
            result, mode = HandoffResult(HandoffOutcome.FAILED, f"wire_version: {exc.message}"), None
        await self.r.inbox.put(HandoffDone(sid, result, mode))

    async def _take_over(self, cmd: TakeOver, to: RouteStubs) -> None:
        """MD takes over from the tokens streamed so far (RLD lost)."""
        leg = cmd.leg
        s = HandoffSlice(leg.sid, cmd.first_position, cmd.token_ids, True, HandoffMode.ONE_SHOT)
        req = pb2.HandoffRequest(handoff=slice_to_wire(s, leg.sampling), emit_given=cmd.emit_given)
        try:
            await to.md.Handoff(req, timeout=self.r.left())
        except grpc.aio.AioRpcError as exc:
            await self.r.inbox.put(TakeoverFailed(leg.sid, exc.code().name.lower()))

    # -- teardown ------------------------------------------------------------------------------------

    async def close(self, *, finished: bool) -> None:
        # P's shipment to MD outlives the request when RLD finished it first: MD must still import
        # the prompt (and cache it), or its DRC falls behind what P sees. It ends by its deadline.
        pending_p = self.r.tasks.running(kinds={TaskKind.PREFILL})
        md_streams = self.r.tasks.running(role=Role.MD, kinds={TaskKind.STREAM})
        kept = set(pending_p) | set(md_streams)
        others = [t for t in self.r.tasks if t not in kept]
        for task in others:
            task.cancel()
        if pending_p and md_streams and finished:
            asyncio.get_running_loop().create_task(self._linger(pending_p, md_streams))
        else:
            for task in kept:
                task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _linger(
        self, pending_p: list[asyncio.Task[None]], md_streams: list[asyncio.Task[None]]
    ) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*pending_p, return_exceptions=True), self.r.left())
        await asyncio.sleep(MD_IMPORT_GRACE_S)
        for task in md_streams + pending_p:
            task.cancel()
        await asyncio.gather(*md_streams, *pending_p, return_exceptions=True)
