"""MD's bridge: lands WAN transfers in the landing region, answers P's reservations from the DRC
that vLLM's KV events feed, and answers vLLM's connector (POLL/RELEASE).

One transfer's life on MD::

    Reserve from P      -> DRC pins the cached prefix (lease); remembered as the transfer's start
    transfer arrives    -> copied into a landing slot          (or: failed, with the reason)
    POLL from vLLM      -> pending (with the start once known) / landed (slot) / failed (reason)
    RELEASE from vLLM   -> the landing slot is freed, the lease ends
    nobody comes        -> ``orphan_s`` after it landed (or after the reservation, when nothing
                           lands) the sweeper frees it (counted as ``swept``)

A transfer that lands after its RELEASE (the request was aborted or recomputed) is dropped at once.

A transfer is named by the router's request key (``sidecar.request_keys``); POLL names only the
transfer, not which vLLM request asks, so what would hand one request's KV to another ends the
transfer (``failed``: vLLM prefills itself, exact) instead: a second Reserve of a key held or
released here (refused too, ``BAD_REQUEST``), a second landing, or KV whose block hashes are not
the reserved prompt's (``kv_mismatch``).

vLLM killed (``engine_lost``, from ``engines_adapter.vllm.engine_link``): every transfer held for it is
released (slots freed; its KV still arriving is dropped as above) and the DRC, vLLM's prefix cache
as it was, is cleared with its leases; the new engine's KV events rebuild it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from pddlink import metrics
from pddlink.connector.control import Op, TransferState
from pddlink.connector.control import field as cfield
from pddlink.connector.shm import ShmRegion, Slot
from pddlink.drc import PrefixIndex, ReservationRefused
from pddlink.drc.reservations import ReservationIds
from pddlink.errors import ErrorCode, InvalidInput, PddlinkError
from pddlink.transport import PeerIdentity, ReceivedTransfer
from pddlink.wire import Release, Reserve, ReserveAnswer, TransferBegin


@dataclass
class Incoming:
    transfer: str
    since: float  # monotonic
    first_block: int | None = None
    slot: Slot | None = None
    num_blocks: int = 0
    bytes_per_block: int = 0
    failed: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    hashes: tuple[int, ...] = ()  # the reserved prompt's block hashes (what a landing must carry)


class ConsumerBridge:
    def __init__(
        self, region: ShmRegion, index: PrefixIndex, *, block_size: int, orphan_s: float = 120.0
    ) -> None:
        self.region, self.index, self.block_size, self.orphan_s = region, index, block_size, orphan_s
        self.inc: dict[str, Incoming] = {}
        self.released: dict[str, float] = {}  # transfer -> when (a late arrival is dropped)
        self.counts = {"landed": 0, "failed": 0, "loaded": 0, "swept": 0, "late_dropped": 0, "key_refused": 0}
        self.counts |= {"engine_lost": 0, "engine_lost_released": 0}
        self.wan_bytes = 0
        self.recomputed: dict[str, int] = {}  # reason -> requests MD's vLLM prefilled itself
        self.finished: dict[str, dict[str, Any]] = {}  # transfer -> vLLM's own hit, at its end
        self.reservations = ReservationIds()  # the wire's reservation ids, as the reference MD grants them

    def _entry(self, transfer: str) -> Incoming:
        e = self.inc.get(transfer)
        if e is None:
            e = self.inc[transfer] = Incoming(transfer, time.monotonic())
        return e

    # -- the KV server's callbacks --------------------------------------------------------------

    def on_message(self, peer: PeerIdentity, msg: Any) -> Any:
        if isinstance(msg, Reserve):
            if refused := self._reserve_refusal(msg.request_id):
                return ReserveAnswer(request_id=msg.request_id, code=ErrorCode.BAD_REQUEST, reason=refused)
            now = time.monotonic()
            try:
                held = self.index.reserve(msg.request_id, list(msg.block_hashes), msg.lease_ms / 1e3, now)
            except PddlinkError as exc:
                return ReserveAnswer(request_id=msg.request_id, code=exc.code, reason=exc.message)
            metrics.DRC_LOOKUPS.inc()
            metrics.DRC_LOOKUP_BLOCKS.inc(held.total_blocks)
            metrics.DRC_HIT_BLOCKS.inc(held.cached_blocks)
            e = self._entry(msg.request_id)
            e.first_block, e.hashes = held.cached_blocks, tuple(msg.block_hashes)
            return ReserveAnswer(
                request_id=msg.request_id,
                reservation_id=self.reservations.grant(msg.request_id),
                cached_blocks=held.cached_blocks,
                lease_ms=msg.lease_ms,
            )
        if isinstance(msg, Release):
            request_id = self.reservations.release(msg.reservation_id)
            if request_id is not None:  # a stale or unknown id releases nothing
                self.index.release(request_id, time.monotonic())
        return None

    def _reserve_refusal(self, transfer: str) -> str:
        """Why a Reserve of ``transfer`` is refused ("" when it is not); a refused one also ends
        the entry held under that key (its POLL cannot tell whose request asks)."""
        if transfer not in self.inc and transfer not in self.released:
            return ""
        self.counts["key_refused"] += 1
        reason = f"key_collision: transfer {transfer!r} is already reserved here, or was lately"
        if (e := self.inc.get(transfer)) is not None and e.failed is None:
            e.failed = reason
        return reason

    def _landing_refusal(self, e: Incoming, begin: TransferBegin) -> str:
        if e.slot is not None or e.failed is not None:
            return f"key_collision: a second landing of transfer {begin.request_id!r}"
        if e.hashes and tuple(begin.block_hashes) != e.hashes[begin.first_block :]:
            return "kv_mismatch: the landed blocks are not the reserved prompt's"
        return ""

    def on_transfer(self, received: ReceivedTransfer) -> None:
        begin = received.begin
        assert isinstance(begin, TransferBegin)
        transfer = begin.request_id
        if transfer in self.released:
            self.counts["late_dropped"] += 1
            return
        e = self._entry(transfer)
        if refused := self._landing_refusal(e, begin):
            self.counts["key_refused"] += 1
            e.failed = e.failed or refused  # a held slot stays until RELEASE: a load may be reading it
            return
        nblocks = -(-begin.num_tokens // self.block_size)
        if nblocks <= 0 or begin.total_bytes % nblocks:
            e.failed = f"bad_request: {begin.total_bytes} bytes for {nblocks} blocks"
            return
        slot = self.region.alloc(begin.total_bytes)
        try:
            self.region.write(slot, list(received.chunks))
        except PddlinkError:
            self.region.free(slot)
            raise
        e.slot, e.first_block, e.num_blocks = slot, begin.first_block, nblocks
        e.since = time.monotonic()  # the orphan clock runs from the landing on
        e.bytes_per_block = begin.total_bytes // nblocks
        e.info = {"wan_bytes": begin.total_bytes, "wan_seconds": received.seconds}
        self.wan_bytes += begin.total_bytes
        self.counts["landed"] += 1

    def on_transfer_failed(self, peer: PeerIdentity, begin: Any, exc: PddlinkError) -> None:
        if isinstance(begin, TransferBegin) and begin.request_id not in self.released:
            self._entry(begin.request_id).failed = f"{exc.code.name.lower()}: {exc.message}"
            self.counts["failed"] += 1
        metrics.TRANSFER_ABORTS.labels(reason=exc.code.name.lower()).inc()

    # -- the connector's control channel -----------------------------------------------------

    def handle(self, op: Op, msg: dict[str, Any]) -> dict[str, Any]:
        self.sweep()
        if op is Op.STATUS:
            return self.status()
        if op is Op.POLL:
            transfers = msg.get("transfers")
            if not isinstance(transfers, list) or not all(isinstance(t, str) for t in transfers):
                raise InvalidInput("POLL needs a list of transfer ids")
            now = time.monotonic()
            for t in transfers:  # a vLLM that still asks cares: its entries are not orphans
                if (e := self.inc.get(t)) is not None:
                    e.since = max(e.since, now)
            return {"states": {t: self._state(t) for t in transfers}}
        if op is Op.RELEASE:
            transfer = cfield(msg, "transfer", str)
            if isinstance(msg.get("local_tokens"), int):  # the request's end: what vLLM held itself
                self.finished[transfer] = {
                    "local_tokens": msg["local_tokens"],
                    "prompt_tokens": msg.get("prompt_tokens"),
                    "loaded": bool(msg.get("loaded")),
                }
                while len(self.finished) > 10_000:
                    self.finished.pop(next(iter(self.finished)))
            reason = str(msg.get("reason", ""))
            if reason not in ("loaded", "request finished", "load failed"):
                key = reason.split(":")[0] or "unknown"
                self.recomputed[key] = self.recomputed.get(key, 0) + 1
            self.release(transfer, loaded=reason == "loaded")
            return {}
        raise InvalidInput(f"MD's sidecar does not take {op.value}")

    def _state(self, transfer: str) -> dict[str, Any]:
        e = self.inc.get(transfer)
        if e is None and transfer in self.released:
            return {"state": TransferState.FAILED, "reason": "cancelled: released (the request ended)"}
        if e is None:
            return {"state": TransferState.PENDING}
        if e.failed is not None:
            return {"state": TransferState.FAILED, "reason": e.failed}
        if e.slot is None:
            return {"state": TransferState.PENDING, "first_block": e.first_block}
        return {
            "state": TransferState.LANDED,
            "offset": e.slot.offset,
            "first_block": e.first_block,
            "num_blocks": e.num_blocks,
            "bytes_per_block": e.bytes_per_block,
        }

    def release(self, transfer: str, *, loaded: bool = False) -> None:
        e = self.inc.pop(transfer, None)
        self.released[transfer] = time.monotonic()
        if e is not None and e.slot is not None:
            self.region.free(e.slot)
            if loaded:
                self.counts["loaded"] += 1
        with contextlib.suppress(ReservationRefused):  # expired, evicted or never granted
            self.index.release(transfer, time.monotonic())

    def engine_lost(self, reason: str) -> int:
        """vLLM died (``reason``): release every transfer held for it, clear the DRC. How many."""
        held = list(self.inc)
        for t in held:
            self.release(t)
        self.index.clear(time.monotonic())
        self.counts["engine_lost"] += 1
        self.counts["engine_lost_released"] += len(held)
        return len(held)

    def sweep(self) -> None:
        now = time.monotonic()
        for t in [t for t, e in self.inc.items() if now - e.since > self.orphan_s]:
            self.release(t)
            self.counts["swept"] += 1
        for t in [t for t, at in self.released.items() if now - at > self.orphan_s]:
            del self.released[t]

    def status(self) -> dict[str, Any]:
        return {
            "region": str(self.region.path),
            "held_slots": self.region.held_slots,
            "held_bytes": self.region.held_bytes,
            "in_flight": len(self.inc),
            "wan_bytes": self.wan_bytes,
            "drc_blocks": len(self.index),
            "recomputed": dict(self.recomputed),
            **self.counts,
        }
