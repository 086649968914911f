"""P: prefill, then ship KV -- the missing suffix to MD over the WAN, the whole KV to RLD on the
fast path -- and hand the first token to whichever decoder starts the stream.

One ``Prefill`` call (router -> P)::

    reserve at MD (its DRC pins the cached prefix; the answer decides what travels)  } concurrently
    prefill on the engine (reusing P's own prefix cache)                              }
    export KV, release the request on P (its full blocks stay in P's prefix cache, and P's DRC
    publishes them to the routers' mirrors of P)
    ship: fast path -> RLD, then P's first token to RLD          } concurrently
          WAN -> MD (blocks from MD's cached length on)           }
          then P's first token to MD when the pipeline is P->MD   }
    reply: first token, bytes, seconds, RTT, retransmits, what failed and why

A WAN transfer that fails or outlives its deadline ends in ``md_ok = False`` with the reason; the
router then falls back (RLD finishes the request). The WAN leg's codec is ``sidecar.wan_codec``'s
choice per transfer (the fast path always goes RAW): ``wan_bytes`` in the reply and the
``pddlink_kv_bytes{path="wan"}`` metric count KV before the codec, ``pddlink_kv_wire_bytes`` what
crossed. A Prefill whose request key is already in flight here is refused at once
(``RequestKeyInUse``, ``sidecar.request_keys``): the one in flight goes on untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from engines_adapter import KVBlocks, SamplingParams, StepOutput
from engines_adapter.drc_host import DrcHost
from engines_adapter.engine_loop import EngineLoop
from pddlink import metrics
from pddlink.errors import DeadlineExceeded, ErrorCode, PddlinkError, Unavailable
from pddlink.handoff import HandoffMode, HandoffSlice
from pddlink.kv.codec import CodecId
from pddlink.kv.hashing import BlockHasher
from pddlink.routing.link import WAN_SHARE_OF_DEADLINE
from pddlink.serving.backlog import WanBook
from pddlink.serving.handoff_wire import slice_to_wire
from pddlink.wire import KVLayoutSpec, Reserve, ReserveAnswer, TransferBegin
from sidecar.edf_gate import EdfGate
from sidecar.peers import DecoderPeer, KVPeer, KVPeerPool
from sidecar.request_keys import RequestKeyInUse
from sidecar.wan_codec import WanCodec

log = logging.getLogger(__name__)

FAST_PATH_TIMEOUT_S = 3.0
_LINK_GONE = (ErrorCode.PEER_UNREACHABLE, ErrorCode.CANCELLED, ErrorCode.UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class PrefillJob:
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    ship_to_md: bool
    ship_to_rld: bool
    first_token_to_md: bool
    deadline_s: float
    md_identity: str = ""  # the MD the router placed it on ("" = the configured peer)
    rld_identity: str = ""  # the RLD a relay goes to ("" = the configured peer)


MdRoute = tuple[KVPeerPool, DecoderPeer]  # an MD's WAN pool and its Sidecar service
RldRoute = tuple[KVPeer, DecoderPeer]  # an RLD's fast path and its Sidecar service


class Prefiller:
    def __init__(
        self,
        loop: EngineLoop,
        *,
        md_kv: KVPeerPool,
        md: DecoderPeer,
        rld_kv: KVPeer | None,
        rld: DecoderPeer | None,
        chunk_bytes: int,
        lease_s: float,
        wan_codec: WanCodec | None = None,
        md_routes: dict[str, MdRoute] | None = None,
        rld_routes: dict[str, RldRoute] | None = None,
        drc: DrcHost | None = None,
    ) -> None:
        """``md_kv``/``md`` and ``rld_kv``/``rld``: the configured peers (a request that names none);
        ``md_routes``/``rld_routes``: every other instance by its identity (a topology's pools);
        ``drc``: P's own prefix cache as a DRC, told each prompt P now holds."""
        self.loop = loop
        self.drc = drc
        self.wan_codec = wan_codec or WanCodec("raw")
        self.md_kv, self.md, self.rld_kv, self.rld = md_kv, md, rld_kv, rld
        self.md_routes, self.rld_routes = dict(md_routes or {}), dict(rld_routes or {})
        self.chunk_bytes = chunk_bytes
        self.lease_s = lease_s
        layout = loop.engine.layout
        self.hasher = BlockHasher(layout.model_id, layout.block_size)
        self.in_flight = 0
        self.keys_in_flight: set[str] = set()  # request keys between Prefill's start and its reply
        self.engine_gate = EdfGate()  # which waiting prefill the engine runs next
        self.in_engine: set[str] = set()  # requests P's engine holds (prefill sent, not released)
        self._tasks: set[asyncio.Future[None]] = set()  # releases and DRC updates running on their own
        self.wan_book = WanBook()  # what is queued toward MD (the router's link estimate reads it)

    async def prefill(self, job: PrefillJob) -> dict[str, Any]:
        if job.request_id in self.keys_in_flight or job.request_id in self.in_engine:
            raise RequestKeyInUse(f"request key {job.request_id!r} is already prefilling here")
        self.keys_in_flight.add(job.request_id)
        self.in_flight += 1
        if job.ship_to_md:
            self.wan_book.will_ship(job.request_id, job.md_identity or self.md.expected.common_name)
        try:
            return await self._prefill(job)
        finally:
            self.in_flight -= 1
            self.keys_in_flight.discard(job.request_id)
            self.wan_book.ended(job.request_id)

    async def _prefill(self, job: PrefillJob) -> dict[str, Any]:
        now = time.monotonic()
        deadline = now + job.deadline_s
        # the WAN gets a share of the time left, so a fallback (RLD finishes) still fits after it
        wan_deadline = now + WAN_SHARE_OF_DEADLINE * job.deadline_s
        hashes = self.hasher.hash_blocks(list(job.prompt))
        reply: dict[str, Any] = {"prompt_tokens": len(job.prompt), "wan_retransmits": -1}
        reservation = (
            asyncio.ensure_future(self._reserve(job, hashes, wan_deadline)) if job.ship_to_md else None
        )
        try:
            first, kv = await self._compute(job, reply, deadline)
        except BaseException:
            if reservation is not None:
                reservation.cancel()
            raise
        if self.drc is not None:  # the prompt's full blocks stay in P's cache: tell the mirrors
            self._background(self._cached(self.drc, hashes))  # not before the KV ships
        reply["first_token"] = first.token_id
        handoff = HandoffSlice(job.request_id, len(job.prompt), (first.token_id,), True, HandoffMode.ONE_SHOT)
        frame = slice_to_wire(handoff, job.sampling)
        tasks = []
        if job.ship_to_rld:
            # the fast path takes tens of ms; a dead RLD must not hold P's reply (and MD's fallback) back
            fast_deadline = min(deadline, time.monotonic() + FAST_PATH_TIMEOUT_S)
            tasks.append(self._ship_rld(job, kv, hashes, frame, fast_deadline, reply))
        if reservation is not None:
            tasks.append(self._ship_md(job, kv, hashes, frame, reservation, wan_deadline, reply))
        await asyncio.gather(*tasks)
        return reply

    async def _compute(
        self, job: PrefillJob, reply: dict[str, Any], deadline: float
    ) -> tuple[StepOutput, KVBlocks]:
        """Prefill on the engine and copy the KV out; P's request is released (prefix cached).

        A call cancelled while the engine prefills (the router ended the request: its deadline, a
        failure, the client gone) still releases it: the engine finishes a prefill it has begun,
        whoever waits, and nothing else would ever release that request on P (its KV blocks stay
        taken in P's pool, and the id stays live: a later request of that id fails)."""
        engine = self.loop.engine
        rid, prompt = job.request_id, list(job.prompt)
        t0 = time.perf_counter()
        async with self.engine_gate.slot(deadline):  # earliest deadline first (sidecar.edf_gate)
            reply["p_cached_tokens"] = await self.loop.call("cached", engine.cached_prefix_tokens, prompt)
            self.in_engine.add(rid)
            try:
                first = await self.loop.call("prefill", engine.prefill, rid, prompt, job.sampling)
            except (asyncio.CancelledError, TimeoutError, DeadlineExceeded):
                await self._release(rid)  # we stopped waiting; the engine may hold the request yet
                raise
            except BaseException:
                self.in_engine.discard(rid)  # the engine failed the prefill: it keeps nothing of it
                raise
            try:
                kv = await self.loop.call("export", engine.export_kv, rid)
            finally:
                await self._release(rid)
        reply["prefill_seconds"] = time.perf_counter() - t0
        return first, kv

    async def _cached(self, drc: DrcHost, hashes: list[int]) -> None:
        try:
            drc.publish(await self.loop.call("drc", drc.insert_hashes, hashes))
        except (PddlinkError, TimeoutError) as exc:  # the engine is gone: the sidecar stops anyway
            log.info("P's DRC: %s", exc)

    def _background(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """``work`` as a task of its own, held until it ends."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _release(self, request_id: str) -> None:
        """Release ``request_id`` on the engine, to the end even when the caller is cancelled (the
        release runs as a task of its own; cancelling the caller stops only its wait)."""
        await asyncio.shield(self._background(self._release_now(request_id)))

    async def _release_now(self, request_id: str) -> None:
        engine = self.loop.engine
        try:
            await self.loop.call("release", engine.release, request_id, cache_prefix=True)
        except (PddlinkError, TimeoutError) as exc:  # a prefill that never ran holds nothing
            log.info("release of %s on P's engine: %s", request_id, exc)
        finally:
            self.in_engine.discard(request_id)

    def md_route(self, job: PrefillJob) -> MdRoute:
        """The MD ``job`` was placed on; ``Unavailable`` when this P knows no such peer."""
        if not job.md_identity:
            return self.md_kv, self.md
        route = self.md_routes.get(job.md_identity.removeprefix("pddlink://"))
        if route is None:
            raise Unavailable(f"no MD peer {job.md_identity} configured", code=ErrorCode.PEER_UNREACHABLE)
        return route

    def rld_route(self, job: PrefillJob) -> RldRoute:
        if not job.rld_identity:
            if self.rld_kv is None or self.rld is None:
                raise Unavailable("no RLD peer configured", code=ErrorCode.PEER_UNREACHABLE)
            return self.rld_kv, self.rld
        route = self.rld_routes.get(job.rld_identity.removeprefix("pddlink://"))
        if route is None:
            raise Unavailable(f"no RLD peer {job.rld_identity} configured", code=ErrorCode.PEER_UNREACHABLE)
        return route

    async def _reserve(self, job: PrefillJob, hashes: list[int], deadline: float) -> int:
        link = self.md_route(job)[0].pick()
        client = await link.client(deadline)
        msg = Reserve(
            request_id=job.request_id, block_hashes=tuple(hashes), lease_ms=int(self.lease_s * 1000)
        )
        try:
            answer = await link.request(msg, deadline)
        except PddlinkError as exc:
            if exc.code in _LINK_GONE:  # a restarted, vanished or silent MD: redial on the next request
                await link.drop(client)
            raise
        if not isinstance(answer, ReserveAnswer) or answer.code is not None:
            reason = getattr(answer, "reason", type(answer).__name__)
            raise Unavailable(f"MD refused the reservation: {reason}", code=ErrorCode.PEER_UNREACHABLE)
        return int(answer.cached_blocks)

    def _begin(
        self, job: PrefillJob, kv: KVBlocks, first_block: int, hashes: list[int], deadline: float
    ) -> tuple[TransferBegin, memoryview]:
        layout = kv.layout
        per_block = layout.bytes_per_block
        payload = memoryview(kv.data).cast("B")[first_block * per_block :]
        begin = TransferBegin(
            transfer_id=random.getrandbits(63),
            generation=0,
            request_id=job.request_id,
            layout=KVLayoutSpec(**layout.to_dict()),
            first_block=first_block,
            num_tokens=len(job.prompt) - first_block * layout.block_size,
            block_hashes=tuple(hashes[first_block:]),
            codec=CodecId.RAW,  # the WAN leg picks its codec in _ship_md
            total_bytes=len(payload),
            chunk_bytes=self.chunk_bytes,
            deadline_ms=max(1, int((deadline - time.monotonic()) * 1000)),
        )
        return begin, payload

    async def _send(self, peer: KVPeer, begin: TransferBegin, payload: memoryview, deadline: float) -> Any:
        return await peer.send(begin, payload, deadline)

    async def _ship_rld(
        self,
        job: PrefillJob,
        kv: KVBlocks,
        hashes: list[int],
        frame: bytes,
        deadline: float,
        reply: dict[str, Any],
    ) -> None:
        try:
            rld_kv, rld = self.rld_route(job)
            begin, payload = self._begin(job, kv, 0, hashes, deadline)
            result = await self._send(rld_kv, begin, payload, deadline)
            await rld.handoff(frame, emit_given=True, timeout_s=max(deadline - time.monotonic(), 0.01))
            reply.update(fast_bytes=result.bytes, fast_seconds=result.seconds, rld_ok=True)
            reply["fast_path"] = rld_kv.transport_name
            metrics.KV_BYTES.labels(path="fast").inc(result.bytes)
            metrics.TRANSFER_SECONDS.labels(path="fast").observe(result.seconds)
        except (PddlinkError, TimeoutError, ConnectionError) as exc:
            reply["rld_error"] = _reason(exc)
            metrics.TRANSFER_ABORTS.labels(reason=_reason_code(exc)).inc()

    async def _ship_md(
        self,
        job: PrefillJob,
        kv: KVBlocks,
        hashes: list[int],
        frame: bytes,
        reservation: asyncio.Future[int],
        deadline: float,
        reply: dict[str, Any],
    ) -> None:
        try:
            cached_blocks = await reservation
            reply["md_cached_tokens"] = cached_blocks * kv.layout.block_size
            begin, payload = self._begin(job, kv, cached_blocks, hashes, deadline)
            decision = self.wan_codec.decide(kv.layout.dtype, payload)
            begin = dataclasses.replace(begin, codec=decision.codec)
            self.wan_book.started(job.request_id, begin.total_bytes)
            md_kv, md = self.md_route(job)
            link = md_kv.pick()
            client = await link.client(deadline)
            before = client.stats().retransmits
            flow = f"{job.request_id}/{begin.transfer_id}"
            self.wan_codec.started(flow, len(payload), time.monotonic())
            result = None
            try:
                result = await self._send(link, begin, payload, deadline)
            finally:
                rtt = client.stats().rtt_s
                self.wan_codec.finished(flow, kv.layout.dtype, result, time.monotonic(), rtt)
            stats = client.stats()
            if job.first_token_to_md:
                await md.handoff(frame, emit_given=True, timeout_s=max(deadline - time.monotonic(), 0.01))
            reply.update(wan_bytes=result.kv_bytes, wan_seconds=result.seconds, md_ok=True)
            if stats.retransmits is not None and before is not None:
                reply["wan_retransmits"] = stats.retransmits - before
            reply["wan_rtt_s"] = stats.rtt_s or 0.0
            reply["compression_ratio"] = result.kv_bytes / result.bytes if result.bytes else 1.0
            codec = result.codec.name.lower()
            metrics.KV_BYTES.labels(path="wan").inc(result.kv_bytes)
            metrics.KV_WIRE_BYTES.labels(path="wan", codec=codec).inc(result.bytes)
            metrics.KV_CODEC_RAW_BYTES.labels(path="wan", codec=codec).inc(result.kv_bytes)
            metrics.TRANSFER_SECONDS.labels(path="wan").observe(result.seconds)
        except (PddlinkError, TimeoutError, ConnectionError) as exc:
            if not reservation.done():
                reservation.cancel()
            reply["md_error"] = _reason(exc)
            metrics.TRANSFER_ABORTS.labels(reason=_reason_code(exc)).inc()
        finally:
            self.wan_book.ended(job.request_id)


def _reason_code(exc: BaseException) -> str:
    if isinstance(exc, PddlinkError):
        return exc.code.name.lower()
    if isinstance(exc, TimeoutError):
        return "deadline_exceeded"
    return "peer_unreachable"


def _reason(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, PddlinkError) else str(exc) or type(exc).__name__
    return f"{_reason_code(exc)}: {text}"
