"""RLD hands a request over to MD: the driver of ``pddlink.handoff.HandoffPlan``.

Once MD holds the KV (the router says so with StartHandoff), RLD sends its generated ids to MD,
one-shot or in catch-up slices, as ``pddlink.lifecycle.handoff_choice.open_handoff`` decides for
every engine (by RLD's load; RLD makes a last token itself). One-shot, or when the
final slice is due, RLD stops decoding first. If MD cannot be reached RLD simply goes on decoding
and finishes the request itself (``failed:...`` is the answer, with the mode tried).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from engines_adapter import SamplingParams
from pddlink import metrics
from pddlink.errors import PddlinkError
from pddlink.handoff import HandoffMode, HandoffPlan
from pddlink.lifecycle import Fallback, HandoffOutcome, HandoffResult, StreamClosed, StreamEnd
from pddlink.lifecycle.decode import handoff_refused
from pddlink.lifecycle.handoff_choice import HandoffAsk, open_handoff
from pddlink.lifecycle.stream import HandoffAnswer
from pddlink.routing import RoutingPolicy
from pddlink.serving.handoff_wire import slice_to_wire

if TYPE_CHECKING:
    from sidecar.decoder import Decoder, DecodeSlot

SendHandoff = Callable[[bytes, float], Awaitable[int]]  # (wire Handoff frame, timeout_s) -> MD's level
POLL_S = 0.002  # catch-up: how often RLD looks for a full slice to send


class RelayHandoff:
    def __init__(
        self,
        decoder: Decoder,
        policy: RoutingPolicy,
        send: SendHandoff | None,
        send_to: Mapping[str, SendHandoff] | None = None,
    ) -> None:
        self.decoder = decoder
        self.policy = policy
        self.send = send
        self.send_to = dict(send_to or {})  # the MDs of a topology, by identity

    async def start(self, request_id: str, deadline_s: float, md_identity: str = "") -> HandoffAnswer:
        d = self.decoder
        slot = d.slots.get(request_id)
        if slot is None or slot.seq.ended:
            how = slot.seq.closed if slot is not None else d.ended_recently.get(request_id)
            return HandoffAnswer(handoff_refused(how))
        send = self.send_to.get(md_identity.removeprefix("pddlink://")) if md_identity else self.send
        sampling = slot.seq.sampling or SamplingParams()
        ask = HandoffAsk(len(slot.seq.generated), sampling.max_tokens, d.load, md_known=send is not None)
        decision = open_handoff(ask, self.policy)
        if isinstance(decision, HandoffResult):
            return HandoffAnswer(decision)
        assert send is not None
        mode = decision.mode
        plan = HandoffPlan(request_id, slot.seq.base, mode, slice_tokens=max(1, decision.slice_tokens or 1))
        try:
            return await self._run(slot, plan, time.monotonic() + deadline_s, send)
        except (PddlinkError, TimeoutError, ConnectionError) as exc:
            seq = slot.seq
            if not seq.ended and not seq.finished and not d.loop.is_decoding(request_id):
                d.loop.decode_in_batch(request_id, lambda o: d.take_step(slot, o))
            metrics.FALLBACKS.labels(kind=Fallback.HANDOFF_FAILED_RLD_FINISHES.value).inc()
            return HandoffAnswer(HandoffResult(HandoffOutcome.FAILED, f"{type(exc).__name__}: {exc}"), mode)

    async def _run(
        self, slot: DecodeSlot, plan: HandoffPlan, deadline: float, send: SendHandoff
    ) -> HandoffAnswer:
        seq, loop = slot.seq, self.decoder.loop
        while not plan.done:
            if seq.ended or seq.finished:  # RLD finished it first: the router releases MD's copy
                return HandoffAnswer(HandoffResult(HandoffOutcome.FINISHED_ON_RLD), plan.mode)
            if plan.mode is HandoffMode.ONE_SHOT or plan.final_due(len(seq.generated)):
                await loop.stop_decoding(seq.request_id)
            s = plan.next_slice(seq.generated)
            if s is None:
                await asyncio.sleep(POLL_S)
                continue
            frame = slice_to_wire(s, seq.sampling or SamplingParams())
            metrics.HANDOFF_SLICES.labels(mode=plan.mode.value).inc()
            metrics.HANDOFF_BYTES.inc(len(frame))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handoff deadline passed")
            plan.on_ack(await send(frame, left))
        metrics.HANDOFFS.labels(mode=plan.mode.value).inc()
        closed = StreamClosed(StreamEnd.HANDED_OFF)
        await self.decoder.end(slot, closed, handoff=(plan.mode, plan.slices_sent))
        handed = HandoffResult(HandoffOutcome.HANDED_OFF)
        return HandoffAnswer(handed, plan.mode, plan.slices_sent, plan.sent_upto)
