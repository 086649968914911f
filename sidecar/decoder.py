"""RelayDecode and MainDecode: the asyncio driver of ``pddlink.lifecycle.DecodeSequence``.

One request's sequence (attach, KV arriving, import, handoff slices, decode, end) is decided by the
machine; this driver does the I/O: the engine calls (through ``EngineLoop``), the DRC updates, and
the token stream (one queue per request, drained by ``attach``). On MD an Attach may ask for a
recompute (ship or recompute): no KV comes, MD prefills the prompt itself
(``decoder_engine.recompute``) and streams a ``ready`` event once it holds the prompt's KV.
RLD's handoff to MD is in ``sidecar.relay_handoff``.

Requests are keyed by the router's request key; what would attach one request's tokens or KV to
another is refused (``sidecar.request_keys``): a second Attach of a key held here, or ended here
lately (``RequestKeyInUse``, before anything changes), KV whose blocks are not the attached
prompt's (the request fails ``kv_mismatch``: it never imports them), a second KV for a key (dropped),
a slice drawn with other sampling or for a key that ended here (``HandoffRefused``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from engines_adapter import KVLayout, SamplingParams, StepOutput
from engines_adapter.drc_host import DrcHost
from engines_adapter.engine_loop import EngineLoop
from pddlink import metrics
from pddlink.errors import LocalError, PddlinkError
from pddlink.handoff import HandoffMode
from pddlink.kv.hashing import BlockHasher
from pddlink.lifecycle import DecodeSequence, SeqState, SliceStep, StreamClosed, StreamEnd
from pddlink.lifecycle.stream import DecodedToken, DecoderEvent, HandoffAnswer, PromptReady, StreamClosing
from pddlink.roles import Role
from pddlink.routing import RoutingPolicy
from pddlink.routing.books import RecomputeMode
from pddlink.serving.handoff_wire import slice_from_wire
from pddlink.transport import ReceivedTransfer
from sidecar import decoder_engine
from sidecar.relay_handoff import RelayHandoff, SendHandoff
from sidecar.request_keys import RequestKeyInUse, kv_mismatch, sampling_mismatch

ENDED_REMEMBERED = 4096  # how many ended requests' outcomes StartHandoff can still look up
FINISHED = StreamClosed(StreamEnd.FINISHED)
RELEASED = StreamClosed(StreamEnd.RELEASED)


@dataclass(slots=True)
class DecodeSlot:
    """A sequence and the asyncio pieces its driver needs."""

    seq: DecodeSequence[ReceivedTransfer]
    imported: asyncio.Event = field(default_factory=asyncio.Event)
    events: asyncio.Queue[DecoderEvent] = field(default_factory=asyncio.Queue)
    handoff_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Decoder:
    def __init__(
        self,
        role: Role | str,
        loop: EngineLoop,
        *,
        drc: DrcHost | None = None,
        capacity: int = 8,
        policy: RoutingPolicy | None = None,
        send_handoff: SendHandoff | None = None,
        send_handoff_to: Mapping[str, SendHandoff] | None = None,
    ) -> None:
        """``send_handoff``: to the configured MD; ``send_handoff_to``: to each other MD by identity."""
        self.role = Role(role)
        self.loop = loop
        self.drc = drc
        self.capacity = capacity
        self.relay = RelayHandoff(self, policy or RoutingPolicy(), send_handoff, send_handoff_to)
        self.slots: dict[str, DecodeSlot] = {}
        # request id -> how it ended (bounded, oldest dropped; None: never closed)
        self.ended_recently: dict[str, StreamClosed | None] = {}
        self.hasher = BlockHasher(loop.engine.layout.model_id, loop.engine.layout.block_size)
        self.refused: dict[str, int] = {"key_in_use": 0, "kv_mismatch": 0, "duplicate_kv": 0, "handoff": 0}

    @property
    def layout(self) -> KVLayout:
        return self.loop.engine.layout

    @property
    def load(self) -> float:
        return sum(1 for s in self.slots.values() if not s.seq.ended) / self.capacity

    def _slot(self, request_id: str) -> DecodeSlot:
        slot = self.slots.get(request_id)
        if slot is None:
            slot = self.slots[request_id] = DecodeSlot(
                DecodeSequence.orphan(request_id, self.role, time.monotonic())
            )
        return slot

    # -- inputs ----------------------------------------------------------------------------------

    def check_attachable(self, request_id: str) -> None:
        """``RequestKeyInUse`` when an Attach of ``request_id`` would share another's entry: one
        attached here now, or one that ended here lately (each leg attaches once per decoder)."""
        slot = self.slots.get(request_id)
        if (slot is not None and slot.seq.prompt) or request_id in self.ended_recently:
            self.refused["key_in_use"] += 1
            raise RequestKeyInUse(f"request key {request_id!r} is in use here (attached, or ended lately)")

    async def attach(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        sampling: SamplingParams,
        deadline_s: float,
        recompute: RecomputeMode = RecomputeMode.NONE,
    ) -> AsyncIterator[DecoderEvent]:
        self.check_attachable(request_id)  # before anything changes: the holder keeps its entry
        slot = self._slot(request_id)
        recomputes = recompute is not RecomputeMode.NONE
        if slot.seq.attach(prompt, sampling, time.monotonic() + deadline_s, recompute=recomputes):
            self._import(slot)
        if recomputes and slot.seq.state is SeqState.IMPORTING:
            asyncio.get_running_loop().create_task(self._recompute(slot, recompute))
        try:
            while True:
                try:
                    left = max(slot.seq.deadline - time.monotonic(), 0.001)
                    ev = await asyncio.wait_for(slot.events.get(), timeout=left)
                except TimeoutError:
                    await self.end(slot, StreamClosed(StreamEnd.FAILED, "deadline_exceeded"))
                    late = slot.seq.closed or StreamClosed(StreamEnd.FAILED, "deadline_exceeded")
                    ev = slot.events.get_nowait() if not slot.events.empty() else StreamClosing(late)
                yield ev
                if isinstance(ev, StreamClosing):
                    return
        finally:
            if not slot.seq.ended:  # the router went away: nobody wants the rest
                await self.end(slot, RELEASED)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        gone = self.slots.pop(request_id, None)
        if gone is not None:
            self.ended_recently[request_id] = gone.seq.closed
            while len(self.ended_recently) > ENDED_REMEMBERED:
                self.ended_recently.pop(next(iter(self.ended_recently)))

    async def on_transfer(self, received: ReceivedTransfer) -> None:
        slot = self._slot(received.begin.request_id)
        if slot.seq.ended:
            return
        if slot.seq.kv is not None or slot.seq.state is not SeqState.WAITING:
            self.refused["duplicate_kv"] += 1  # a second KV for one key: never the held request's
            return
        path = "wan" if self.role is Role.MD else "fast"
        metrics.KV_BYTES.labels(path=path).inc(sum(len(c) for c in received.chunks))
        if slot.seq.kv_arrived(received):
            self._import(slot)

    def _import(self, slot: DecodeSlot) -> None:
        asyncio.get_running_loop().create_task(self._run_import(slot, slot.seq.take_kv()))

    async def _run_import(self, slot: DecodeSlot, kv: ReceivedTransfer) -> None:
        if mismatch := kv_mismatch(kv.begin, slot.seq.prompt, self.hasher):
            self.refused["kv_mismatch"] += 1
            slot.seq.import_error = mismatch
            slot.imported.set()
            await self.end(slot, StreamClosed(StreamEnd.FAILED, mismatch))
            return
        try:
            await decoder_engine.import_kv(self.loop, self.drc, slot.seq, kv)
            slot.seq.import_done()
        except PddlinkError as exc:
            await self.end(slot, slot.seq.import_failed(exc.message))
        finally:
            slot.imported.set()

    async def _recompute(self, slot: DecodeSlot, mode: RecomputeMode) -> None:
        """Ship or recompute: prefill the prompt here (``decoder_engine.recompute``), then say
        ``ready``; with AND_DECODE also stream the first token and decode, else wait for RLD's
        handoff."""
        seq = slot.seq
        try:
            out, took, cached = await decoder_engine.recompute(self.loop, self.drc, seq)
        except PddlinkError as exc:
            seq.import_error = f"recompute_failed: {exc.message}"
            slot.imported.set()
            await self.end(slot, StreamClosed(StreamEnd.FAILED, seq.import_error))
            return
        seq.import_done()
        slot.imported.set()
        if seq.ended:  # released while prefilling: its end() found nothing to free yet
            await decoder_engine.release_prefilled(self.loop, seq.request_id)
            return
        slot.events.put_nowait(PromptReady(took, cached))
        if mode is RecomputeMode.AND_DECODE:
            self.take_step(slot, out)
            if seq.start_decoding():
                self.loop.decode_in_batch(seq.request_id, lambda o: self.take_step(slot, o))

    async def handoff(self, frame: bytes, *, emit_given: bool, sender_finished: bool) -> int:
        """A slice for this decoder: extend with it; the final one starts decoding here."""
        s, sampling = slice_from_wire(frame)
        if s.request_id in self.ended_recently and s.request_id not in self.slots:
            self.refused["handoff"] += 1
            raise HandoffRefused(f"request {s.request_id!r} already ended here")
        slot = self._slot(s.request_id)
        seq = slot.seq
        async with slot.handoff_lock:
            left = max(seq.deadline - time.monotonic(), 0.001)
            await asyncio.wait_for(slot.imported.wait(), timeout=left)
            if refused := seq.refusal() or sampling_mismatch(sampling, seq.sampling):
                self.refused["handoff"] += 1
                raise HandoffRefused(refused)
            step = seq.on_slice(s, sender_finished=sender_finished)
            if step is SliceStep.RELEASE:  # the sender finished the request: keep only the cached prefix
                await self.end(slot, RELEASED)
            elif step is SliceStep.COMPLETE:  # nothing left to generate (max tokens, stop token)
                if emit_given:
                    self._emit_ids(slot, s.first_position, s.token_ids, last_is_last=True)
                if s.final:
                    await self.end(slot, FINISHED)
            else:
                out = await self.loop.call(
                    "extend", self.loop.engine.extend, seq.request_id, list(s.token_ids)
                )
                if emit_given:
                    self._emit_ids(slot, s.first_position, s.token_ids, last_is_last=False)
                if s.final:
                    self.take_step(slot, out)
                    if seq.start_decoding():
                        self.loop.decode_in_batch(seq.request_id, lambda o: self.take_step(slot, o))
            return s.end_position

    # -- outputs ---------------------------------------------------------------------------------

    def _emit_ids(self, slot: DecodeSlot, first: int, ids: tuple[int, ...], *, last_is_last: bool) -> None:
        for i, tok in enumerate(ids):
            slot.events.put_nowait(DecodedToken(first + i, tok, last_is_last and i == len(ids) - 1))

    def take_step(self, slot: DecodeSlot, out: StepOutput | None) -> None:
        if slot.seq.ended:
            return
        if out is None:
            asyncio.get_running_loop().create_task(
                self.end(slot, StreamClosed(StreamEnd.FAILED, "engine_error"))
            )
            return
        slot.seq.on_token(out.token_id, out.finished)
        slot.events.put_nowait(DecodedToken(out.position, out.token_id, out.finished))
        if out.finished:
            asyncio.get_running_loop().create_task(self.end(slot, FINISHED))

    async def end(
        self, slot: DecodeSlot, closed: StreamClosed, handoff: tuple[HandoffMode, int] | None = None
    ) -> None:
        """Close the request here: out of the batch, engine released, closing event streamed
        (``handoff``: the mode and slices of a handoff that closed it)."""
        plan = slot.seq.end(closed)
        if plan is None:
            return
        await decoder_engine.release(self.loop, self.drc, slot.seq.request_id, cache_prefix=plan.cache_prefix)
        mode, slices = handoff if handoff is not None else (None, 0)
        slot.events.put_nowait(StreamClosing(closed, mode, slices))

    async def release(self, request_id: str, reason: str) -> bool:
        slot = self.slots.get(request_id)
        if slot is None:
            return False
        await self.end(slot, RELEASED)
        return True

    async def start_handoff(self, request_id: str, deadline_s: float, md_identity: str = "") -> HandoffAnswer:
        """RLD: hand the request over to MD (``md_identity``: the one the router placed it on; see
        ``sidecar.relay_handoff``)."""
        return await self.relay.start(request_id, deadline_s, md_identity)

    def status(self) -> dict[str, Any]:
        live = [s.seq for s in self.slots.values() if not s.seq.ended]
        return {
            "requests": len(live),
            "decoding": sum(1 for s in live if s.state is SeqState.DECODING),
            "waiting_kv": sum(1 for s in live if not s.imported),
            "load": self.load,
            "refused": dict(self.refused),
        }


class HandoffRefused(LocalError):
    """MD cannot take the slice (its KV import failed, or the request already ended)."""
