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
import time
from collections.abc import AsyncIterator
from typing import Any

from pddlink import metrics
from pddlink.routing import Pipeline
from sidecar.backlog import md_miss_label
from sidecar.recompute import RecomputeMode
from sidecar.router_legs import Cluster, RunInput, RunLegs

__all__ = ["Cluster", "RequestRun", "RunInput"]


class RequestRun(RunLegs):
    """The actor: starts the first leg, then reacts to each result in the inbox until the request
    finishes, fails with a reason, or its deadline passes."""

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
        leg.md_ok = bool(r.md_ok) or leg.recompute is not RecomputeMode.NONE  # MD prefills it itself
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
            p_cached_tokens=int(r.p_cached_tokens),
            fast_path=r.fast_path,
            prefill_seconds=r.prefill_seconds,
        )
        if leg.recompute is RecomputeMode.NONE:
            t["md_cached_tokens"] = int(r.md_cached_tokens)  # else MD's ready event says
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
            why = md_miss_label(r.md_error)  # a full line is congestion, not an unreachable MD
            if pipeline is Pipeline.P_RLD_MD and leg.rld_ok:
                self._fallback(f"{why}_rld_finishes")
            elif self.c.rld_usable() and self.legs < 4:
                self._fallback(f"{why}_p_rld")
                self._start_leg(Pipeline.SINGULAR)
            else:
                self.failed_reason = f"{why}: {r.md_error}"
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
