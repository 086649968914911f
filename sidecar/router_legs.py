"""A router request's legs on the sidecars: its state, the RPCs it makes, and its teardown.

``RunLegs`` holds one request's state (merged stream, legs, which streams are alive, trace) and
makes its RPCs, each as a task that posts exactly one result to the inbox: the Attach streams on
RLD and MD (token events, then how the stream ended), P's Prefill, RLD's StartHandoff, and the
router's own Handoff to MD when RLD is lost. Every RPC's timeout is the request's time left.
``_close`` cancels what is left (P's shipment to MD may linger until its deadline so MD still
caches the prompt), then records metrics and the trace. ``RequestRun`` (``sidecar.router_run``)
is the actor that reacts to the results and takes the fallbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from engines_adapter import SamplingParams
from pddlink import metrics
from pddlink.handoff import HandoffMode, HandoffSlice, StreamMerger
from pddlink.routing import Option, Pipeline
from sidecar.handoff_wire import slice_to_wire
from sidecar.recompute import RecomputeMode
from sidecar.rpc import stubs
from sidecar.sampling_pb import sampling_to_pb

pb2, _ = stubs()


class Cluster(Protocol):
    p: Any
    rld: Any
    md: Any
    rld_active: int

    def rld_usable(self) -> bool: ...

    def on_prefilled(self, request_id: str, new_tokens: int, seconds: float) -> None: ...

    def on_md_ready(self, request_id: str, new_tokens: int, seconds: float) -> None: ...


@dataclass
class RunInput:
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    deadline_s: float
    pipeline: Pipeline
    reason: str
    wan_estimate_s: float
    option: Option = Option.SHIP


@dataclass
class Leg:
    """One sub-request on the sidecars: (prompt, max tokens) from some position on."""

    sid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    pipeline: Pipeline
    first_token: int | None = None
    md_ok: bool | None = None
    rld_ok: bool | None = None
    recompute: RecomputeMode = RecomputeMode.NONE  # MD prefills the prompt itself (first leg only)
    md_ready: asyncio.Event | None = None  # set when MD's recompute is done


class RunLegs:
    """One request's state and its RPCs to the sidecars (see the module docstring)."""

    def __init__(self, cluster: Cluster, inp: RunInput) -> None:
        self.c = cluster
        self.inp = inp
        self.t_start = time.monotonic()
        self.deadline = self.t_start + inp.deadline_s
        self.base = len(inp.prompt)
        self.merger = StreamMerger(self.base, inp.sampling.max_tokens)
        self.inbox: asyncio.Queue[tuple[str, str, Any, str]] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.legs = 0
        self.leg: Leg | None = None
        self.rld_stream_alive = False
        self.md_stream_alive = False
        self.rld_handed_off = False
        self.ttft_s: float | None = None
        self.trace: dict[str, Any] = {
            "pipeline": inp.pipeline.value,
            "decision_reason": inp.reason,
            "wan_estimate_s": inp.wan_estimate_s,
            "wan_bytes": 0,
            "fast_bytes": 0,
            "handoff_mode": "",
            "fallbacks": [],
            "prompt_tokens": self.base,
        }
        self.failed_reason = ""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # -- plumbing --------------------------------------------------------------------------------

    def _spawn(self, name: str, coro: Any) -> None:
        self.tasks[name] = asyncio.get_running_loop().create_task(coro)

    async def _stream(self, name: str, stub: Any, leg: Leg) -> None:
        req = pb2.AttachRequest(
            request_id=leg.sid,
            prompt=list(leg.prompt),
            sampling=sampling_to_pb(leg.sampling),
            deadline_s=max(self.left(), 0.01),
            recompute=int(leg.recompute) if name == "md" else 0,
        )
        how = "failed:stream_closed"
        try:
            async for ev in stub.Attach(req, timeout=max(self.left(), 0.01)):
                if ev.ready:  # MD's recompute is done: it holds the prompt's KV
                    self._md_ready(leg, ev)
                    continue
                if ev.end:
                    how = ev.end
                    if ev.handoff_mode:
                        self.trace["handoff_mode"] = ev.handoff_mode
                    break
                await self.inbox.put(("tok", name, ev, leg.sid))
        except grpc.aio.AioRpcError as exc:
            how = f"failed:{exc.code().name.lower()}"
        except asyncio.CancelledError:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await asyncio.wait_for(
                    stub.Release(pb2.ReleaseRequest(request_id=leg.sid, reason="router")), 1.0
                )
            raise
        await self.inbox.put(("end", name, how, leg.sid))

    async def _prefill(self, leg: Leg, to_md: bool, to_rld: bool, t0_to_md: bool) -> None:
        req = pb2.PrefillRequest(
            request_id=leg.sid,
            prompt=list(leg.prompt),
            sampling=sampling_to_pb(leg.sampling),
            ship_to_md=to_md,
            ship_to_rld=to_rld,
            first_token_to_md=t0_to_md,
            deadline_s=max(self.left() - 0.2, 0.01),
        )
        try:
            reply = await self.c.p.Prefill(req, timeout=max(self.left(), 0.01))
            self.c.on_prefilled(leg.sid, len(leg.prompt) - reply.p_cached_tokens, reply.prefill_seconds)
            await self.inbox.put(("prefill", "p", reply, leg.sid))
        except grpc.aio.AioRpcError as exc:
            await self.inbox.put(
                ("prefill_failed", "p", f"{exc.code().name.lower()}: {exc.details()}", leg.sid)
            )

    def _md_ready(self, leg: Leg, ev: Any) -> None:
        self.trace.update(md_recompute_s=ev.recompute_seconds, md_cached_tokens=int(ev.cached_tokens))
        self.c.on_md_ready(leg.sid, len(leg.prompt) - int(ev.cached_tokens), ev.recompute_seconds)
        if leg.md_ready is not None:
            leg.md_ready.set()

    async def _start_handoff(self, leg: Leg) -> None:
        try:
            if leg.md_ready is not None:  # relay + recompute: hand over once MD holds the prompt
                await asyncio.wait_for(leg.md_ready.wait(), timeout=max(self.left() - 0.1, 0.01))
            reply = await self.c.rld.StartHandoff(
                pb2.HandoffStart(request_id=leg.sid, deadline_s=max(self.left() - 0.1, 0.01)),
                timeout=max(self.left(), 0.01),
            )
            await self.inbox.put(("handoff", "rld", reply, leg.sid))
        except grpc.aio.AioRpcError as exc:
            failed = pb2.HandoffStartReply(outcome=f"failed:{exc.code().name}")
            await self.inbox.put(("handoff", "rld", failed, leg.sid))
        except TimeoutError:
            failed = pb2.HandoffStartReply(outcome="failed:md_recompute_late")
            await self.inbox.put(("handoff", "rld", failed, leg.sid))

    async def _router_handoff(self, leg: Leg) -> None:
        """MD takes over from the tokens streamed so far (RLD lost)."""
        given = list(self.merger.emitted) or ([leg.first_token] if leg.first_token is not None else [])
        first_pos = len(leg.prompt)
        ids = tuple(given[first_pos - self.base :])
        s = HandoffSlice(leg.sid, first_pos, ids, True, HandoffMode.ONE_SHOT)
        emit = not self.merger.emitted
        try:
            await self.c.md.Handoff(
                pb2.HandoffRequest(handoff=slice_to_wire(s, leg.sampling), emit_given=emit),
                timeout=max(self.left(), 0.01),
            )
        except grpc.aio.AioRpcError as exc:
            await self.inbox.put(("md_takeover_failed", "md", exc.code().name.lower(), leg.sid))

    def _start_leg(self, pipeline: Pipeline) -> Leg:
        """A (sub-)request from the merged position on: prompt + tokens already streamed."""
        self.legs += 1
        done = tuple(self.merger.emitted)
        s = self.inp.sampling
        sampling = SamplingParams(
            s.seed, s.temperature, s.top_k, s.top_p, s.max_tokens - len(done), s.stop_token_ids
        )
        sid = self.inp.request_id if self.legs == 1 else f"{self.inp.request_id}#{self.legs}"
        leg = Leg(sid, self.inp.prompt + done, sampling, pipeline)
        if self.legs == 1 and self.inp.option.recomputes:  # fallback legs ship KV as before
            leg.recompute = RecomputeMode.of(self.inp.option)
            leg.md_ready = asyncio.Event()
        self.leg = leg
        use_md = pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD)
        use_rld = pipeline in (Pipeline.P_RLD_MD, Pipeline.SINGULAR)
        if use_md:
            self.md_stream_alive = True
            self._spawn(f"md{self.legs}", self._stream("md", self.c.md, leg))
        if use_rld:
            self.rld_stream_alive = True
            self.c.rld_active += 1
            self._spawn(f"rld{self.legs}", self._stream("rld", self.c.rld, leg))
        ships = use_md and leg.recompute is RecomputeMode.NONE
        if leg.recompute is RecomputeMode.AND_DECODE:
            # MD prefills and streams itself; P prefills too, shipping nothing, so its own prefix
            # cache keeps seeing every prompt (P's and MD's caches stay aligned)
            leg.md_ok = True
        t0_to_md = pipeline is Pipeline.P_MD and ships
        self._spawn(f"p{self.legs}", self._prefill(leg, ships, use_rld, t0_to_md))
        return leg

    async def _linger(
        self, pending_p: list[asyncio.Task[None]], md_streams: list[asyncio.Task[None]]
    ) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*pending_p, return_exceptions=True), max(self.left(), 0.01))
        await asyncio.sleep(0.2)  # MD imports right after the transfer; release it after that
        for task in md_streams + pending_p:
            task.cancel()
        await asyncio.gather(*md_streams, *pending_p, return_exceptions=True)

    def _fallback(self, kind: str) -> None:
        self.trace["fallbacks"].append(kind)
        metrics.FALLBACKS.labels(kind=kind).inc()

    # -- the actor ---------------------------------------------------------------------------------

    def _rld_ended(self) -> None:
        if self.rld_stream_alive:
            self.rld_stream_alive = False
            self.c.rld_active -= 1

    def _cancel_stream(self, who: str) -> None:
        for name, task in list(self.tasks.items()):
            if name.startswith(who) and name[len(who) :].isdigit():
                task.cancel()
        if who == "md":
            self.md_stream_alive = False
        else:
            self._rld_ended()

    async def _close(self) -> None:
        self._rld_ended()
        # P's shipment to MD outlives the request when RLD finished it first: MD must still import
        # the prompt (and cache it), or its DRC falls behind what P sees. It ends by its deadline.
        pending_p = [t for n, t in self.tasks.items() if n.startswith("p") and not t.done()]
        md_streams = [t for n, t in self.tasks.items() if n.startswith("md") and not t.done()]
        for task in self.tasks.values():
            if task not in pending_p and task not in md_streams:
                task.cancel()
        if pending_p and md_streams and self.merger.finished:
            asyncio.get_running_loop().create_task(self._linger(pending_p, md_streams))
        else:
            for task in pending_p + md_streams:
                task.cancel()
        await asyncio.gather(
            *(t for t in self.tasks.values() if t not in pending_p and t not in md_streams),
            return_exceptions=True,
        )
        pipeline = self.inp.pipeline.value
        metrics.REQUESTS_IN_FLIGHT.labels(pipeline=pipeline).dec()
        outcome = "finished" if self.merger.finished else "failed"
        if outcome == "failed" and not self.failed_reason:
            self.failed_reason = "cancelled"
        metrics.REQUESTS.labels(pipeline=pipeline, outcome=outcome).inc()
        if self.ttft_s is not None:
            metrics.TTFT_SECONDS.labels(pipeline=pipeline).observe(self.ttft_s)
        for src, n in self.merger.by_source.items():
            metrics.TOKENS.labels(source=src).inc(n)
        if self.inp.pipeline is Pipeline.P_RLD_MD:
            self.trace.setdefault("handoff_outcome", "not_started")  # RLD finished before MD was ready
        self.trace.update(
            outcome=outcome,
            reason=self.failed_reason,
            ttft_s=self.ttft_s,
            e2e_s=time.monotonic() - self.t_start,
            tokens=dict(self.merger.by_source),
            output_tokens=self.merger.generated,
            divergences=self.merger.divergences,
        )
