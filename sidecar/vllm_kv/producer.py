"""P's bridge: answers vLLM's connector (PREPARE/ALLOC/COMMIT/RELEASE) and ships region slots to MD.

One transfer's life on P::

    PREPARE (vLLM starts the request)   -> reserve MD's cached prefix over the WAN link (a task)
    ALLOC   (prefill done, in vLLM)     -> a region slot for the blocks from MD's prefix on
                                           (all of them while the reservation is unanswered)
    COMMIT  (the slot holds the KV)     -> a task: wait for the reservation, ship the suffix MD
                                           lacks, free the slot (acked, failed or past deadline)
    RELEASE (the request ended early)   -> cancel the reservation, free what is held

Only whole blocks below the one holding the prompt's last token travel: MD's vLLM recomputes that
tail (fewer than ``block_size`` tokens) from a block-aligned prefix, as after a local prefix hit.
(vLLM's CPU bf16 kernels die with SIGILL when a request resumes mid-block, and a partial block's
interior is the kernel's own.) When MD already holds every such block nothing is copied or sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any

from pddlink import metrics
from pddlink.errors import ErrorCode, InvalidInput, NotFound, PddlinkError, Unavailable
from pddlink.kv.codec import CodecId
from pddlink.kv.hashing import BlockHasher
from pddlink.wire import KVLayoutSpec, Reserve, ReserveAnswer, TransferBegin
from sidecar.peers import KVPeer
from sidecar.vllm_kv.control import Op
from sidecar.vllm_kv.control import field as cfield
from sidecar.vllm_kv.shm import ShmRegion, Slot
from sidecar.wan_codec import WanCodec

LEASE_S = 30.0


@dataclass
class Outgoing:
    transfer: str
    hashes: list[int]
    num_tokens: int
    deadline_at: float  # wall clock
    reservation: asyncio.Task[int] | None = None
    slot: Slot | None = None
    ship: asyncio.Task[None] | None = None
    per_block: int = 0
    result: dict[str, Any] = field(default_factory=dict)


class ProducerBridge:
    def __init__(
        self,
        region: ShmRegion,
        md: KVPeer,
        *,
        model_id: str,
        block_size: int,
        chunk_bytes: int = 4 << 20,
        wan_codec: WanCodec | None = None,
    ) -> None:
        self.region, self.md = region, md
        self.wan_codec = wan_codec or WanCodec()  # per line: compress when the line is slower
        self.hasher = BlockHasher(model_id, block_size)
        self.model_id, self.block_size, self.chunk_bytes = model_id, block_size, chunk_bytes
        self.out: dict[str, Outgoing] = {}
        self.done: dict[str, dict[str, Any]] = {}  # finished transfers' results (bounded)
        self.counts = {"shipped": 0, "failed": 0, "released": 0}

    def handle(self, op: Op, msg: dict[str, Any]) -> dict[str, Any]:
        if op is Op.STATUS:
            return self.status()
        transfer = cfield(msg, "transfer", str)
        if op is Op.PREPARE:
            return self._prepare(transfer, msg)
        if op is Op.ALLOC:
            return self._alloc(self._get(transfer), msg)
        if op is Op.COMMIT:
            return self._commit(self._get(transfer), msg)
        if op is Op.RELEASE:
            self._release(transfer, str(msg.get("reason", "")))
            return {}
        raise InvalidInput(f"P's sidecar does not take {op.value}")

    def _get(self, transfer: str) -> Outgoing:
        out = self.out.get(transfer)
        if out is None:
            raise NotFound(f"unknown transfer {transfer!r} (no PREPARE)")
        return out

    def _prepare(self, transfer: str, msg: dict[str, Any]) -> dict[str, Any]:
        prompt = msg.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise InvalidInput("PREPARE needs the prompt's token ids")
        if transfer in self.out:
            raise InvalidInput(f"transfer {transfer!r} is already in flight")
        out = Outgoing(
            transfer, self.hasher.hash_blocks(prompt), len(prompt), cfield(msg, "deadline_at", float)
        )
        out.reservation = asyncio.ensure_future(self._reserve(out))
        self.out[transfer] = out
        return {}

    async def _reserve(self, out: Outgoing) -> int:
        deadline = time.monotonic() + max(out.deadline_at - time.time(), 0.01)
        client = await self.md.client(deadline)
        msg = Reserve(request_id=out.transfer, block_hashes=tuple(out.hashes), lease_ms=int(LEASE_S * 1000))
        try:
            answer = await client.request(msg, timeout_s=max(deadline - time.monotonic(), 0.01))
        except PddlinkError as exc:
            if exc.code in (ErrorCode.PEER_UNREACHABLE, ErrorCode.CANCELLED, ErrorCode.UNAVAILABLE):
                await self.md.drop()
            raise
        if not isinstance(answer, ReserveAnswer) or answer.code is not None:
            raise Unavailable(f"MD refused the reservation: {getattr(answer, 'reason', answer)}")
        return int(answer.cached_blocks)

    def _alloc(self, out: Outgoing, msg: dict[str, Any]) -> dict[str, Any]:
        num_blocks, per_block = cfield(msg, "num_blocks", int), cfield(msg, "bytes_per_block", int)
        if out.slot is not None:
            raise InvalidInput(f"transfer {out.transfer!r} already holds a slot")
        first = 0
        r = out.reservation
        if r is not None and r.done() and not r.cancelled() and r.exception() is None:
            first = min(r.result(), num_blocks)
        out.per_block = per_block
        if first == num_blocks:  # MD holds every block that travels: nothing to copy or ship
            return {"offset": 0, "nbytes": 0, "first_block": first}
        out.slot = self.region.alloc((num_blocks - first) * per_block)
        return {"offset": out.slot.offset, "nbytes": out.slot.nbytes, "first_block": first}

    def _commit(self, out: Outgoing, msg: dict[str, Any]) -> dict[str, Any]:
        if out.ship is not None:
            raise InvalidInput(f"transfer {out.transfer!r}: COMMIT twice")
        copied_first, num_blocks = cfield(msg, "first_block", int), cfield(msg, "num_blocks", int)
        if out.slot is None:  # nothing was copied: MD already holds it all
            out.result.update(ok=True, wan_bytes=0, wan_seconds=0.0, first_block=copied_first)
            self.counts["shipped"] += 1
            self._finish(out)
            return {}
        layout = KVLayoutSpec(**{"model_id": self.model_id, **cfield(msg, "layout", dict)})
        out.ship = asyncio.ensure_future(self._ship(out, layout, copied_first, num_blocks))
        return {}

    async def _ship(self, out: Outgoing, layout: KVLayoutSpec, copied_first: int, num_blocks: int) -> None:
        assert out.slot is not None and out.reservation is not None
        slot = out.slot
        per_block = out.per_block
        t0 = time.perf_counter()
        try:
            deadline = time.monotonic() + max(out.deadline_at - time.time(), 0.01)
            try:
                reserved = await out.reservation
            except PddlinkError as exc:  # MD could not say what it holds: ship everything copied
                out.result["reserve_error"] = f"{exc.code.name.lower()}: {exc.message}"
                reserved = 0
            first = max(copied_first, min(reserved, num_blocks - 1))  # the slot holds >= 1 block
            start = slot.offset + (first - copied_first) * per_block
            payload = self.region.view[start : slot.end]
            begin = TransferBegin(
                transfer_id=random.getrandbits(63),
                generation=0,
                request_id=out.transfer,
                layout=layout,
                first_block=first,
                num_tokens=(num_blocks - first) * self.block_size,
                block_hashes=tuple(out.hashes[first:]),
                codec=CodecId.RAW,
                total_bytes=payload.nbytes,
                chunk_bytes=self.chunk_bytes,
                deadline_ms=max(1, int((deadline - time.monotonic()) * 1000)),
            )
            decision = self.wan_codec.decide(layout.dtype, payload)
            begin = dataclasses.replace(begin, codec=decision.codec)
            client = await self.md.client(deadline)
            flow = f"{out.transfer}/{begin.transfer_id}"
            self.wan_codec.started(flow, payload.nbytes, time.monotonic())
            result = None
            try:
                result = await client.send_transfer(
                    begin, payload, deadline_s=max(deadline - time.monotonic(), 0.01)
                )
            finally:
                payload.release()
                self.wan_codec.finished(flow, layout.dtype, result, time.monotonic(), client.stats().rtt_s)
            codec = result.codec.name.lower()
            out.result.update(
                ok=True,
                wan_bytes=result.kv_bytes,  # KV before the codec; wire_bytes is what crossed
                wire_bytes=result.bytes,
                codec=codec,
                wan_seconds=result.seconds,
                first_block=first,
            )
            metrics.KV_BYTES.labels(path="wan").inc(result.kv_bytes)
            metrics.KV_WIRE_BYTES.labels(path="wan", codec=codec).inc(result.bytes)
            metrics.KV_CODEC_RAW_BYTES.labels(path="wan", codec=codec).inc(result.kv_bytes)
            self.counts["shipped"] += 1
        except (PddlinkError, TimeoutError, ConnectionError, OSError) as exc:
            reason = f"{exc.code.name.lower()}: {exc.message}" if isinstance(exc, PddlinkError) else repr(exc)
            out.result.update(ok=False, error=reason)
            metrics.TRANSFER_ABORTS.labels(reason=reason.split(":")[0]).inc()
            self.counts["failed"] += 1
            if isinstance(exc, PddlinkError) and exc.code in (
                ErrorCode.PEER_UNREACHABLE,
                ErrorCode.CANCELLED,
            ):
                await self.md.drop()
        finally:
            out.result["ship_seconds"] = time.perf_counter() - t0
            self._finish(out)

    def _release(self, transfer: str, reason: str) -> None:
        out = self.out.get(transfer)
        if out is None or out.ship is not None:
            return  # unknown, or already shipping (the ship task frees it)
        if out.reservation is not None:
            out.reservation.cancel()
        out.result.update(ok=False, error=f"released: {reason}")
        self.counts["released"] += 1
        self._finish(out)

    def _finish(self, out: Outgoing) -> None:
        if out.slot is not None:
            self.region.free(out.slot)
            out.slot = None
        self.out.pop(out.transfer, None)
        self.done[out.transfer] = out.result
        while len(self.done) > 10_000:
            self.done.pop(next(iter(self.done)))

    def status(self) -> dict[str, Any]:
        return {
            "region": str(self.region.path),
            "held_slots": self.region.held_slots,
            "held_bytes": self.region.held_bytes,
            "in_flight": len(self.out),
            **self.counts,
        }

    async def close(self) -> None:
        tasks = [t for o in self.out.values() for t in (o.reservation, o.ship) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
