"""RelayDecode and MainDecode: requests whose KV arrives from P, decoded here, streamed by position.

One request on a decoder (``DecodeSeq``), whatever the order its inputs arrive in::

    Attach (router: prompt, sampling, deadline; opens the token stream)
    KV transfer (P, over the fast path or the WAN)     -> import_kv once both are here
      or, on MD, recompute (Attach says so): prefill the prompt here, then a ``ready`` event
    Handoff slices (P's first token, RLD's tokens, or the router's on a fallback)
        -> extend in one forward pass; the final slice starts decoding here
    decode steps (batched with the other requests)    -> tokens streamed with their positions
    finished | handed off (RLD) | released | failed   -> the stream's closing event

RLD also runs ``start_handoff``: once MD holds the KV it sends its generated ids to MD, one-shot or
in catch-up slices, following ``pddlink.handoff.HandoffPlan``; if MD cannot be reached it simply
keeps decoding and finishes the request itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engines_adapter import KVBlocks, KVLayout, SamplingParams, StepOutput
from pddlink import metrics
from pddlink.errors import LocalError, PddlinkError
from pddlink.handoff import HandoffIntake, HandoffMode, HandoffPlan
from pddlink.routing import RoutingPolicy, choose_handoff_mode
from pddlink.transport import ReceivedTransfer
from sidecar.drc_host import DrcHost
from sidecar.engine_loop import EngineLoop
from sidecar.handoff_wire import slice_from_wire, slice_to_wire
from sidecar.recompute import RecomputeMode

SendHandoff = Callable[[bytes, float], Awaitable[int]]  # (wire Handoff frame, timeout_s) -> MD's level


@dataclass(slots=True)
class DecodeSeq:
    request_id: str
    deadline: float = 0.0
    prompt: tuple[int, ...] = ()
    sampling: SamplingParams | None = None
    kv: ReceivedTransfer | None = None
    importing: bool = False
    imported: asyncio.Event = field(default_factory=asyncio.Event)
    import_error: str = ""
    events: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)  # ids at positions base, base+1, ...
    intake: HandoffIntake | None = None
    decoding: bool = False
    finished: bool = False
    ended: str = ""
    handoff_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def base(self) -> int:
        return len(self.prompt)

    @property
    def ready_to_import(self) -> bool:
        return bool(self.prompt) and self.kv is not None and not self.importing


class Decoder:
    def __init__(
        self,
        role: str,
        loop: EngineLoop,
        *,
        drc: DrcHost | None = None,
        capacity: int = 8,
        policy: RoutingPolicy | None = None,
        send_handoff: SendHandoff | None = None,
    ) -> None:
        self.role = role
        self.loop = loop
        self.drc = drc
        self.capacity = capacity
        self.policy = policy or RoutingPolicy()
        self.send_handoff = send_handoff
        self.seqs: dict[str, DecodeSeq] = {}
        self.ended_recently: dict[str, str] = {}  # request id -> how it ended (bounded, oldest dropped)

    @property
    def layout(self) -> KVLayout:
        return self.loop.engine.layout

    @property
    def load(self) -> float:
        return sum(1 for s in self.seqs.values() if not s.ended) / self.capacity

    def _seq(self, request_id: str) -> DecodeSeq:
        seq = self.seqs.get(request_id)
        if seq is None:
            seq = self.seqs[request_id] = DecodeSeq(request_id, deadline=time.monotonic() + 60.0)
        return seq

    # -- inputs ----------------------------------------------------------------------------------

    async def attach(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        sampling: SamplingParams,
        deadline_s: float,
        recompute: RecomputeMode = RecomputeMode.NONE,
    ) -> AsyncIterator[dict[str, Any]]:
        seq = self._seq(request_id)
        seq.prompt, seq.sampling = prompt, sampling
        seq.deadline = time.monotonic() + deadline_s
        if recompute is not RecomputeMode.NONE:
            seq.importing = True  # no KV comes: this decoder prefills the prompt itself
            asyncio.get_running_loop().create_task(self._recompute(seq, recompute))
        self._maybe_import(seq)
        try:
            while True:
                left = seq.deadline - time.monotonic()
                try:
                    ev = await asyncio.wait_for(seq.events.get(), timeout=max(left, 0.001))
                except TimeoutError:
                    await self.end(seq, "failed:deadline_exceeded")  # queues the closing event
                    ev = seq.events.get_nowait() if not seq.events.empty() else {"end": seq.ended}
                yield ev
                if ev.get("end"):
                    return
        finally:
            if not seq.ended:  # the router went away: nobody wants the rest
                await self.end(seq, "released")
            gone = self.seqs.pop(request_id, None)
            if gone is not None:
                self.ended_recently[request_id] = gone.ended
                while len(self.ended_recently) > 4096:
                    self.ended_recently.pop(next(iter(self.ended_recently)))

    async def on_transfer(self, received: ReceivedTransfer) -> None:
        seq = self._seq(received.begin.request_id)
        if seq.ended:
            return
        seq.kv = received
        metrics.KV_BYTES.labels(path="wan" if self.role == "md" else "fast").inc(
            sum(len(c) for c in received.chunks)
        )
        self._maybe_import(seq)

    def _maybe_import(self, seq: DecodeSeq) -> None:
        if seq.ready_to_import:
            seq.importing = True
            asyncio.get_running_loop().create_task(self._import(seq))

    async def _import(self, seq: DecodeSeq) -> None:
        assert seq.kv is not None and seq.sampling is not None
        begin = seq.kv.begin
        data = b"".join(seq.kv.chunks)
        seq.kv = None  # the payload is copied into the pool below; drop the chunks
        layout = self.layout
        try:
            blocks = KVBlocks(
                layout, begin.first_block, len(data) // layout.bytes_per_block, begin.num_tokens, data
            )
            reuse = begin.first_block * layout.block_size
            await self.loop.call(
                "import",
                self.loop.engine.import_kv,
                seq.request_id,
                list(seq.prompt),
                [blocks],
                seq.sampling,
                reuse_prefix_tokens=reuse,
            )
            if self.drc is not None:
                events = await self.loop.call("drc", self.drc.commit, seq.request_id, seq.prompt)
                self.drc.publish(events)
        except PddlinkError as exc:
            seq.import_error = f"import_failed: {exc.message}"
            await self.end(seq, f"failed:{seq.import_error}")
        finally:
            seq.imported.set()

    async def _recompute(self, seq: DecodeSeq, mode: RecomputeMode) -> None:
        """Ship or recompute: prefill the prompt from its token ids, reusing this engine's own
        prefix cache (the DRC reservation counts the lookup as P's would), then say ``ready``;
        with AND_DECODE also stream the first token and decode, else wait for RLD's handoff."""
        assert seq.sampling is not None
        engine, prompt = self.loop.engine, list(seq.prompt)
        try:
            cached = await self.loop.call("cached", engine.cached_prefix_tokens, prompt)
            if self.drc is not None:
                hashes = self.drc.hasher.hash_blocks(prompt)
                _, events = await self.loop.call("drc", self.drc.reserve, seq.request_id, hashes, 30.0)
                self.drc.publish(events)
            t0 = time.perf_counter()
            out = await self.loop.call("prefill", engine.prefill, seq.request_id, prompt, seq.sampling)
            took = time.perf_counter() - t0
            if self.drc is not None:
                self.drc.publish(await self.loop.call("drc", self.drc.commit, seq.request_id, seq.prompt))
        except PddlinkError as exc:
            seq.import_error = f"recompute_failed: {exc.message}"
            seq.imported.set()
            await self.end(seq, f"failed:{seq.import_error}")
            return
        seq.imported.set()
        if seq.ended:  # released while prefilling: its end() found nothing to free yet
            with contextlib.suppress(PddlinkError):
                await self.loop.call("release", engine.release, seq.request_id, cache_prefix=True)
            return
        seq.events.put_nowait({"ready": True, "recompute_seconds": took, "cached_tokens": cached})
        if mode is RecomputeMode.AND_DECODE and not seq.ended:
            self._take(seq, out)
            if not seq.finished:
                seq.decoding = True
                self.loop.decode_in_batch(seq.request_id, lambda o: self._take(seq, o))

    async def handoff(self, frame: bytes, *, emit_given: bool, sender_finished: bool) -> int:
        """A slice for this decoder: extend with it; the final one starts decoding here."""
        s, _sampling = slice_from_wire(frame)
        seq = self._seq(s.request_id)
        async with seq.handoff_lock:
            await asyncio.wait_for(seq.imported.wait(), timeout=max(seq.deadline - time.monotonic(), 0.001))
            if seq.import_error or seq.ended:
                raise HandoffRefused(seq.import_error or f"request already ended ({seq.ended})")
            if sender_finished:  # the sender finished the request: keep only the cached prefix
                await self.end(seq, "released")
                return s.end_position
            if seq.intake is None:
                seq.intake = HandoffIntake(seq.request_id, seq.base)
            ids = seq.intake.accept(s)
            seq.generated[s.first_position - seq.base :] = list(ids)
            if self._complete(seq, ids):  # nothing left to generate (max tokens, stop token): no extend
                if emit_given:
                    for i, tok in enumerate(ids):
                        self._emit(seq, s.first_position + i, tok, i == len(ids) - 1)
                if s.final:
                    seq.finished = True
                    await self.end(seq, "finished")
                return s.end_position
            out = await self.loop.call("extend", self.loop.engine.extend, seq.request_id, list(ids))
            if emit_given:
                for i, tok in enumerate(ids):
                    self._emit(seq, s.first_position + i, tok, False)
            if s.final:
                self._take(seq, out)
                if not seq.finished:
                    seq.decoding = True
                    self.loop.decode_in_batch(seq.request_id, lambda o: self._take(seq, o))
            return s.end_position

    @staticmethod
    def _complete(seq: DecodeSeq, ids: tuple[int, ...]) -> bool:
        sampling = seq.sampling
        if sampling is None:
            return False
        return len(seq.generated) >= sampling.max_tokens or (bool(ids) and ids[-1] in sampling.stop_token_ids)

    # -- outputs ---------------------------------------------------------------------------------

    def _emit(self, seq: DecodeSeq, position: int, token_id: int, last: bool) -> None:
        seq.events.put_nowait({"position": position, "token_id": token_id, "last": last})

    def _take(self, seq: DecodeSeq, out: StepOutput | None) -> None:
        if seq.ended:
            return
        if out is None:
            asyncio.get_running_loop().create_task(self.end(seq, "failed:engine_error"))
            return
        seq.generated.append(out.token_id)
        self._emit(seq, out.position, out.token_id, out.finished)
        if out.finished:
            seq.finished = True
            seq.decoding = False
            asyncio.get_running_loop().create_task(self.end(seq, "finished"))

    async def end(self, seq: DecodeSeq, how: str, **extra: Any) -> None:
        """Close the request here: out of the batch, engine released, closing event streamed."""
        if seq.ended:
            return
        seq.ended = how
        await self.loop.stop_decoding(seq.request_id)
        keep = self.role == "md" and how in ("finished", "released")
        with contextlib.suppress(PddlinkError):
            tokens = await self.loop.call("tokens", self.loop.engine.tokens, seq.request_id)
            await self.loop.call("release", self.loop.engine.release, seq.request_id, cache_prefix=keep)
            if keep and self.drc is not None:
                events = await self.loop.call("drc", self.drc.insert, tokens[:-1])
                self.drc.publish(events)
        if self.drc is not None and not keep:
            await self.loop.call("drc", self.drc.release, seq.request_id)
        seq.events.put_nowait({"end": how, **extra})

    async def release(self, request_id: str, reason: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        await self.end(seq, "released")
        return True

    # -- RLD: hand the request over to MD ---------------------------------------------------------

    async def start_handoff(self, request_id: str, deadline_s: float) -> dict[str, Any]:
        seq = self.seqs.get(request_id)
        if seq is None or seq.ended:
            how = seq.ended if seq is not None else self.ended_recently.get(request_id, "")
            if how == "finished":  # RLD finished it before MD was ready: nothing to hand over
                return {"outcome": "finished_on_rld"}
            return {"outcome": f"failed:{how or 'unknown_request'}"}
        if self.send_handoff is None:
            return {"outcome": "failed:no_md_configured"}
        decision = choose_handoff_mode(self.load, self.policy)
        mode = HandoffMode(decision.mode.value)
        plan = HandoffPlan(request_id, seq.base, mode, slice_tokens=max(1, decision.slice_tokens or 1))
        deadline = time.monotonic() + deadline_s
        try:
            return await self._run_handoff(seq, plan, deadline, self.send_handoff)
        except (PddlinkError, TimeoutError, ConnectionError) as exc:
            if not seq.ended and not seq.finished and not self.loop.is_decoding(request_id):
                self.loop.decode_in_batch(request_id, lambda o: self._take(seq, o))
            metrics.FALLBACKS.labels(kind="handoff_failed_rld_finishes").inc()
            return {"outcome": f"failed:{type(exc).__name__}: {exc}", "mode": mode.value}

    async def _run_handoff(
        self, seq: DecodeSeq, plan: HandoffPlan, deadline: float, send: SendHandoff
    ) -> dict[str, Any]:
        while not plan.done:
            if seq.ended or seq.finished:  # RLD finished it first: the router releases MD's copy
                return {"outcome": "finished_on_rld", "mode": plan.mode.value}
            if plan.mode is HandoffMode.ONE_SHOT or plan.final_due(len(seq.generated)):
                await self.loop.stop_decoding(seq.request_id)
            s = plan.next_slice(seq.generated)
            if s is None:
                await asyncio.sleep(0.002)
                continue
            frame = slice_to_wire(s, seq.sampling or SamplingParams())
            metrics.HANDOFF_SLICES.labels(mode=plan.mode.value).inc()
            metrics.HANDOFF_BYTES.inc(len(frame))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handoff deadline passed")
            level = await send(frame, left)
            plan.on_ack(level)
        metrics.HANDOFFS.labels(mode=plan.mode.value).inc()
        await self.end(seq, "handed_off", handoff_mode=plan.mode.value, handoff_slices=plan.slices_sent)
        return {
            "outcome": "handed_off",
            "mode": plan.mode.value,
            "slices": plan.slices_sent,
            "end_position": plan.sent_upto,
        }

    def status(self) -> dict[str, Any]:
        live = [s for s in self.seqs.values() if not s.ended]
        return {
            "requests": len(live),
            "decoding": sum(1 for s in live if s.decoding),
            "waiting_kv": sum(1 for s in live if not s.imported.is_set()),
            "load": self.load,
        }


class HandoffRefused(LocalError):
    """MD cannot take the slice (its KV import failed, or the request already ended)."""
