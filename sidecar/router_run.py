"""One request at the router: dispatch to P/RLD/MD, merge the streams, take fallbacks, end in time.

The run is an actor: the decoder streams, P's prefill reply and RLD's handoff result all arrive in
one inbox; ``run()`` reacts to each and yields merged tokens (``StreamMerger``: no gap, no
duplicate) until the request finishes, fails with a reason, or its deadline passes.

Fallbacks (each recorded in ``trace["fallbacks"]``):

- the WAN transfer to MD failed: on P->RLD->MD RLD simply finishes; on P->MD P re-ships to RLD
  (P's prefix cache makes the second prefill cheap) and RLD finishes;
- RLD is lost (fast path failed, or its stream broke): MD takes over from the tokens streamed so far
  (a handoff sent by the router);
- MD is lost after taking over: P prefills prompt + streamed tokens and RLD finishes (sampling is a
  function of (seed, position), so the continuation is the same);
- P is lost: the request fails with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from engines_adapter import SamplingParams
from pddlink import metrics
from pddlink.handoff import HandoffMode, HandoffSlice, StreamMerger
from pddlink.routing import Pipeline
from sidecar.handoff_wire import slice_to_wire
from sidecar.rpc import stubs

pb2, _ = stubs()


class Cluster(Protocol):
    p: Any
    rld: Any
    md: Any
    rld_active: int

    def rld_usable(self) -> bool: ...


@dataclass
class RunInput:
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    deadline_s: float
    pipeline: Pipeline
    reason: str
    wan_estimate_s: float


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


@dataclass
class Trace:
    fields: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.fields[key] = self.fields.get(key, 0) + value


def _sampling_pb(s: SamplingParams) -> Any:
    return pb2.Sampling(
        seed=s.seed,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        stop_token_ids=list(s.stop_token_ids),
    )


class RequestRun:
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
            sampling=_sampling_pb(leg.sampling),
            deadline_s=max(self.left(), 0.01),
        )
        how = "failed:stream_closed"
        try:
            async for ev in stub.Attach(req, timeout=max(self.left(), 0.01)):
                if ev.end:
                    how = ev.end
                    if ev.handoff_mode:
                        self.trace["handoff_mode"] = ev.handoff_mode
                    break
                await self.inbox.put(("tok", name, ev, leg.sid))
        except grpc.aio.AioRpcError as exc:
            how = f"failed:{exc.code().name.lower()}"
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    stub.Release(pb2.ReleaseRequest(request_id=leg.sid, reason="router")), 1.0
                )
            raise
        await self.inbox.put(("end", name, how, leg.sid))

    async def _prefill(self, leg: Leg, to_md: bool, to_rld: bool, t0_to_md: bool) -> None:
        req = pb2.PrefillRequest(
            request_id=leg.sid,
            prompt=list(leg.prompt),
            sampling=_sampling_pb(leg.sampling),
            ship_to_md=to_md,
            ship_to_rld=to_rld,
            first_token_to_md=t0_to_md,
            deadline_s=max(self.left() - 0.2, 0.01),
        )
        try:
            reply = await self.c.p.Prefill(req, timeout=max(self.left(), 0.01))
            await self.inbox.put(("prefill", "p", reply, leg.sid))
        except grpc.aio.AioRpcError as exc:
            await self.inbox.put(
                ("prefill_failed", "p", f"{exc.code().name.lower()}: {exc.details()}", leg.sid)
            )

    async def _start_handoff(self, leg: Leg) -> None:
        try:
            reply = await self.c.rld.StartHandoff(
                pb2.HandoffStart(request_id=leg.sid, deadline_s=max(self.left() - 0.1, 0.01)),
                timeout=max(self.left(), 0.01),
            )
            await self.inbox.put(("handoff", "rld", reply, leg.sid))
        except grpc.aio.AioRpcError as exc:
            failed = pb2.HandoffStartReply(outcome=f"failed:{exc.code().name}")
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
        self._spawn(f"p{self.legs}", self._prefill(leg, use_md, use_rld, pipeline is Pipeline.P_MD))
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

    async def run(self) -> AsyncIterator[Any]:
        metrics.REQUESTS_IN_FLIGHT.labels(pipeline=self.inp.pipeline.value).inc()
        try:
            self._start_leg(self.inp.pipeline)
            while not self.merger.finished and not self.failed_reason:
                left = self.left()
                if left <= 0:
                    self.failed_reason = "deadline_exceeded"
                    break
                try:
                    kind, who, item, sid = await asyncio.wait_for(self.inbox.get(), timeout=left)
                except TimeoutError:
                    self.failed_reason = "deadline_exceeded"
                    break
                if kind != "tok" and self.leg is not None and sid != self.leg.sid:
                    continue  # a superseded leg: its tokens still count (positions), nothing else does
                for tok in self._on(kind, who, item):
                    yield tok
            await self._await_p_reply()
        finally:
            await self._close()

    async def _await_p_reply(self) -> None:
        """On P->MD, MD can finish a short output before P's reply (its trace: bytes, RTT) is in;
        that reply is moments away (MD already had P's first token), so wait for it briefly."""
        leg = self.leg
        if leg is None or leg.pipeline is not Pipeline.P_MD or leg.md_ok is not None or self.failed_reason:
            return
        deadline = time.monotonic() + min(1.0, max(self.left(), 0.0))
        while leg.md_ok is None and (left := deadline - time.monotonic()) > 0:
            try:
                kind, who, item, sid = await asyncio.wait_for(self.inbox.get(), timeout=left)
            except TimeoutError:
                return
            if kind == "prefill" and sid == leg.sid:
                self._on(kind, who, item)

    def _on(self, kind: str, who: str, item: Any) -> list[Any]:
        if kind == "tok":
            out = self.merger.offer(item.position, item.token_id, who, last=item.last)
            if out and self.ttft_s is None:
                self.ttft_s = time.monotonic() - self.t_start
            return out
        if kind == "end":
            self._on_stream_end(who, item)
        elif kind == "prefill":
            self._on_prefill(item)
        elif kind == "prefill_failed":
            self.failed_reason = f"p_unavailable: {item}"
        elif kind == "handoff":
            self._on_handoff(item)
        elif kind == "md_takeover_failed":
            self._md_lost(f"md_takeover_failed:{item}")
        return []

    def _on_prefill(self, r: Any) -> None:
        leg = self.leg
        assert leg is not None
        leg.first_token = int(r.first_token)
        leg.md_ok = bool(r.md_ok)
        leg.rld_ok = bool(r.rld_ok)
        t = self.trace
        t["wan_bytes"] += int(r.wan_bytes)
        t["fast_bytes"] += int(r.fast_bytes)
        t.update(
            wan_seconds=r.wan_seconds,
            fast_seconds=r.fast_seconds,
            wan_rtt_s=r.wan_rtt_s,
            wan_retransmits=int(r.wan_retransmits),
            compression_ratio=r.compression_ratio or 1.0,
            md_cached_tokens=int(r.md_cached_tokens),
            p_cached_tokens=int(r.p_cached_tokens),
            fast_path=r.fast_path,
            prefill_seconds=r.prefill_seconds,
        )
        if r.md_error:
            t["md_error"] = r.md_error
        if r.rld_error:
            t["rld_error"] = r.rld_error
        if self.merger.finished:
            return  # only the trace fields matter now
        pipeline = leg.pipeline
        wants_md = pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD)
        if wants_md and not leg.md_ok:
            self._cancel_stream("md")
            if pipeline is Pipeline.P_RLD_MD and leg.rld_ok:
                self._fallback("md_unreachable_rld_finishes")
            elif self.c.rld_usable() and self.legs < 4:
                self._fallback("md_unreachable_p_rld")
                self._start_leg(Pipeline.SINGULAR)
            else:
                self.failed_reason = f"md_unreachable: {r.md_error}"
            return
        if pipeline is Pipeline.P_RLD_MD:
            if not leg.rld_ok or not self.rld_stream_alive:
                self._fallback("rld_unreachable_md_takes_over")
                self._cancel_stream("rld")
                self._spawn("takeover", self._router_handoff(leg))
            else:
                self._spawn("handoff", self._start_handoff(leg))
        if pipeline is Pipeline.SINGULAR and not leg.rld_ok:
            self.failed_reason = f"rld_unreachable: {r.rld_error}"

    def _on_handoff(self, r: Any) -> None:
        self.trace["handoff_outcome"] = r.outcome
        if r.mode:
            self.trace["handoff_mode"] = r.mode
        if r.outcome == "handed_off":
            self.rld_handed_off = True
        elif r.outcome.startswith("finished_on_rld"):
            self._cancel_stream("md")
        else:
            self._fallback("handoff_failed_rld_finishes")
            self._cancel_stream("md")

    def _on_stream_end(self, who: str, how: str) -> None:
        if who == "rld":
            self._rld_ended()
            if how in ("handed_off", "finished") or self.merger.finished:
                return
            leg = self.leg
            assert leg is not None
            if self.md_stream_alive and leg.md_ok:
                self._fallback("rld_lost_md_takes_over")
                self._spawn("takeover", self._router_handoff(leg))
            elif self.md_stream_alive and leg.md_ok is None:
                leg.rld_ok = False  # MD takes over once P's reply says it holds the KV
            elif self.c.rld_usable() is False and self.legs < 4:
                self._fallback("rld_lost_p_md")
                self._start_leg(Pipeline.P_MD)
            else:
                self.failed_reason = f"rld_lost: {how}"
            return
        self.md_stream_alive = False
        if how == "finished" or self.merger.finished or how == "released":
            return
        self._md_lost(how)

    def _md_lost(self, how: str) -> None:
        self.md_stream_alive = False
        if self.rld_stream_alive and not self.rld_handed_off:
            self._fallback("md_lost_rld_finishes")
            self.tasks.pop("handoff", None)
            return
        if self.c.rld_usable() and self.legs < 4:
            self._fallback("md_lost_p_rld")
            self._start_leg(Pipeline.SINGULAR)
        else:
            self.failed_reason = f"md_lost: {how}"

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
