"""P's bridge: answers vLLM's connector (PREPARE/ALLOC/COMMIT/RELEASE) and ships region slots to
its destinations: MD across the WAN and, when configured, RelayDecode (RLD) over the fast path.

Each destination is a *leg* (``md``, ``rld``) with its own link, reservation and ship task; one
prefill on P feeds them all from one region slot. One transfer's life on P::

    PREPARE (vLLM starts the request)   -> per leg: reserve the destination's cached prefix (a task);
                                           RLD's sidecar keeps no DRC, so RLD's answer is 0 blocks
                                           and RLD gets every whole block
    ALLOC   (prefill done, in vLLM)     -> a region slot for the blocks from the smallest reserved
                                           prefix on (all of them while a reservation is unanswered)
    COMMIT  (the slot holds the KV)     -> per leg, a task: wait for its reservation, ship the suffix
                                           that destination lacks; the slot is freed once every leg
                                           ended (acked, failed or past deadline)
    RELEASE (the request ended early)   -> cancel the reservations, free what is held

``PREPARE`` may name the legs (``to``: ["rld", "md"]); by default every configured leg. With pools
(``named``: P's sidecar links every MD and RLD of a topology by its instance name) it names each
leg's instance too (``"md": NAME``, ``"rld": NAME``); without a name a leg goes to the role's one
configured peer (``md``, ``rld``, or the only named one). A name P links no instance of, or none
where several are linked, fails that transfer (``NotFound`` / ``InvalidInput`` answered to the
PREPARE, the reason in ``done[transfer]``); the bridge serves on.
The finished record (``done[transfer]``) holds the MD leg's result at its top level (as before RLD
existed) and every leg's under ``legs``.

A transfer is named by the router's request key (``sidecar.request_keys``). ALLOC and COMMIT name
only the transfer, not which vLLM request saves, so a second PREPARE of a key this bridge holds
(or held lately) is refused (``RequestKeyInUse``) and, while the held one has not committed yet,
ends it too (released, ``key_collision``): whichever request's worker allocated first would
otherwise ship its KV under the other's key. Both destinations then prefill themselves (exact).

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
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pddlink import metrics
from pddlink.connector.control import Op
from pddlink.connector.control import field as cfield
from pddlink.connector.shm import ShmRegion, Slot
from pddlink.errors import ErrorCode, InvalidInput, NotFound, PddlinkError, Unavailable
from pddlink.kv.codec import CodecId
from pddlink.kv.hashing import BlockHasher
from pddlink.transport.base import TransferResult
from pddlink.wire import KVLayoutSpec, Reserve, ReserveAnswer, TransferBegin
from sidecar.peers import KVPeer, redial_after
from sidecar.request_keys import RequestKeyInUse
from sidecar.wan_codec import WanCodec

LEASE_S = 30.0
PREPARE_WAIT_S = 2.0  # how long an ALLOC that came before its PREPARE waits for it


@dataclass
class Destination:
    """One destination of a transfer (RLD or MD), its reservation, its ship task and its result.
    Not the lifecycle's ``Leg`` (a sub-request on the sidecars)."""

    name: str  # the role: "md" or "rld"
    peer: KVPeer
    instance: str = ""  # the instance's name in the topology ("" = the role's configured peer)
    reservation: asyncio.Task[int] | None = None
    ship: asyncio.Task[None] | None = None
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outgoing:
    transfer: str
    hashes: list[int]
    num_tokens: int
    deadline_at: float  # wall clock
    legs: dict[str, Destination] = field(default_factory=dict)
    slot: Slot | None = None
    copied_first: int = 0
    per_block: int = 0
    committed: bool = False


class ProducerBridge:
    def __init__(
        self,
        region: ShmRegion,
        md: KVPeer | None,
        *,
        model_id: str,
        block_size: int,
        chunk_bytes: int = 4 << 20,
        wan_codec: WanCodec | None = None,
        rld: KVPeer | None = None,
        named: Mapping[str, Mapping[str, KVPeer]] | None = None,
    ) -> None:
        """``md``, ``rld``: each role's peer when a request names no instance; ``named``: role ->
        instance name -> peer (a topology's pools)."""
        self.region = region
        self.peers = {name: peer for name, peer in (("md", md), ("rld", rld)) if peer is not None}
        self.named = {role: dict(peers) for role, peers in (named or {}).items() if peers}
        self.roles = [r for r in ("md", "rld") if r in self.peers or r in self.named]
        if not self.roles:
            raise InvalidInput("P's bridge needs a destination (MD, RLD or both)")
        self.wan_codec = wan_codec or WanCodec()  # per line: compress when the line is slower
        self.hasher = BlockHasher(model_id, block_size)
        self.model_id, self.block_size, self.chunk_bytes = model_id, block_size, chunk_bytes
        self.out: dict[str, Outgoing] = {}
        self._prepared: dict[str, asyncio.Event] = {}  # ALLOCs that came before their PREPARE
        self.done: dict[str, dict[str, Any]] = {}  # finished transfers' results (bounded)
        self.counts = {"shipped": 0, "failed": 0, "released": 0}
        self.leg_counts: dict[str, dict[str, int]] = {
            name: {"shipped": 0, "failed": 0, "bytes": 0} for name in self.roles
        }
        self.instance_counts = {
            name: {"shipped": 0, "failed": 0, "bytes": 0} for peers in self.named.values() for name in peers
        }

    @property
    def md(self) -> KVPeer | None:
        return self.peers.get("md")

    def handle(self, op: Op, msg: dict[str, Any]) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        if op is Op.STATUS:
            return self.status()
        transfer = cfield(msg, "transfer", str)
        if op is Op.PREPARE:
            return self._prepare(transfer, msg)
        if op is Op.ALLOC:
            if transfer not in self.out and transfer not in self.done:
                return self._alloc_once_prepared(transfer, msg)
            return self._alloc(self._get(transfer), msg)
        if op is Op.COMMIT:
            return self._commit(self._get(transfer), msg)
        if op is Op.RELEASE:
            self._release(transfer, str(msg.get("reason", "")))
            return {}
        raise InvalidInput(f"P's sidecar does not take {op.value}")

    async def _alloc_once_prepared(self, transfer: str, msg: dict[str, Any]) -> dict[str, Any]:
        """ALLOC before its PREPARE: vLLM's worker sends ALLOC on a connection of its own, and the
        scheduler's PREPARE, written just before on the other, can be read after it (measured: 2
        of 32 requests, whose KV then never left P: MD and RLD waited out the transfer deadline
        and prefilled themselves). Wait for the PREPARE, a bounded time."""
        event = self._prepared.setdefault(transfer, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), PREPARE_WAIT_S)
        except TimeoutError:
            pass
        finally:
            self._prepared.pop(transfer, None)
        return self._alloc(self._get(transfer), msg)

    def _get(self, transfer: str) -> Outgoing:
        out = self.out.get(transfer)
        if out is None:
            raise NotFound(f"unknown transfer {transfer!r} (no PREPARE)")
        return out

    def _legs(self, msg: dict[str, Any]) -> list[str]:
        to = msg.get("to")
        if to is None:
            return list(self.roles)
        if not isinstance(to, list) or not to or not all(isinstance(t, str) for t in to):
            raise InvalidInput(f"PREPARE's 'to' must be a non-empty list of destinations, got {to!r}")
        unknown = [t for t in to if t not in self.roles]
        if unknown:
            raise InvalidInput(f"P's sidecar has no link to {unknown} (configured: {self.roles})")
        return list(dict.fromkeys(to))

    def _peer(self, role: str, msg: dict[str, Any]) -> tuple[KVPeer, str]:
        """The peer (and its instance name) ``role``'s leg of this PREPARE ships to."""
        name = msg.get(role)
        named = self.named.get(role, {})
        if name is None:
            default = self.peers.get(role)
            if default is not None:
                return default, ""
            if len(named) == 1:
                only = next(iter(named))
                return named[only], only
            raise InvalidInput(f"PREPARE names no {role} instance, and P's sidecar links {len(named)}")
        if not isinstance(name, str):
            raise InvalidInput(f"PREPARE's {role!r} must be an instance name, got {name!r}")
        peer = named.get(name)
        if peer is None:
            known = ", ".join(named) or "none by name"
            raise NotFound(f"no {role} instance {name!r} among P's sidecar's peers ({known})")
        return peer, name

    def _prepare(self, transfer: str, msg: dict[str, Any]) -> dict[str, Any]:
        prompt = msg.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise InvalidInput("PREPARE needs the prompt's token ids")
        if transfer in self.out or transfer in self.done:
            self._release(transfer, "key_collision: a second PREPARE of this transfer")
            raise RequestKeyInUse(f"transfer {transfer!r} is already in flight here, or was lately")
        try:
            names = self._legs(msg)
            peers = {name: self._peer(name, msg) for name in names}
        except PddlinkError as exc:  # this transfer fails; the bridge serves on
            self.counts["failed"] += 1
            reason = f"{exc.code.name.lower()}: {exc.message}"
            self._record(transfer, {"ok": False, "error": reason, "legs": {}})
            raise
        out = Outgoing(
            transfer, self.hasher.hash_blocks(prompt), len(prompt), cfield(msg, "deadline_at", float)
        )
        for name in names:
            peer, instance = peers[name]
            leg = out.legs[name] = Destination(name, peer, instance)
            if instance:
                leg.result["instance"] = instance
            leg.reservation = asyncio.ensure_future(self._reserve(out, leg))
        self.out[transfer] = out
        waiting = self._prepared.get(transfer)
        if waiting is not None:  # its ALLOC came first (see _alloc_once_prepared)
            waiting.set()
        return {"legs": names}

    async def _reserve(self, out: Outgoing, leg: Destination) -> int:
        deadline = time.monotonic() + max(out.deadline_at - time.time(), 0.01)
        client = await leg.peer.client(deadline)
        msg = Reserve(request_id=out.transfer, block_hashes=tuple(out.hashes), lease_ms=int(LEASE_S * 1000))
        try:
            answer = await client.request(msg, timeout_s=max(deadline - time.monotonic(), 0.01))
        except PddlinkError as exc:
            if exc.code in (ErrorCode.PEER_UNREACHABLE, ErrorCode.UNAVAILABLE) or not client.usable:
                await leg.peer.drop(client)  # this link only, and never for a cancel (see _ship)
            raise
        if not isinstance(answer, ReserveAnswer) or answer.code is not None:
            raise Unavailable(f"{leg.name} refused the reservation: {getattr(answer, 'reason', answer)}")
        return int(answer.cached_blocks)

    @staticmethod
    def _reserved(leg: Destination) -> int | None:
        r = leg.reservation
        if r is not None and r.done() and not r.cancelled() and r.exception() is None:
            return r.result()
        return None

    def _alloc(self, out: Outgoing, msg: dict[str, Any]) -> dict[str, Any]:
        num_blocks, per_block = cfield(msg, "num_blocks", int), cfield(msg, "bytes_per_block", int)
        if out.slot is not None or out.per_block:
            raise InvalidInput(f"transfer {out.transfer!r} already holds a slot")
        known = [self._reserved(leg) for leg in out.legs.values()]
        first = min(min(k if k is not None else 0 for k in known), num_blocks)
        out.per_block, out.copied_first = per_block, first
        if first == num_blocks:  # every destination holds every block that travels: nothing to copy
            return {"offset": 0, "nbytes": 0, "first_block": first}
        out.slot = self.region.alloc((num_blocks - first) * per_block)
        return {"offset": out.slot.offset, "nbytes": out.slot.nbytes, "first_block": first}

    def _commit(self, out: Outgoing, msg: dict[str, Any]) -> dict[str, Any]:
        if out.committed:
            raise InvalidInput(f"transfer {out.transfer!r}: COMMIT twice")
        out.committed = True
        copied_first, num_blocks = cfield(msg, "first_block", int), cfield(msg, "num_blocks", int)
        layout = KVLayoutSpec(**{"model_id": self.model_id, **cfield(msg, "layout", dict)})
        for leg in out.legs.values():
            leg.ship = asyncio.ensure_future(self._ship(out, leg, layout, copied_first, num_blocks))
        return {}

    async def _ship(
        self, out: Outgoing, leg: Destination, layout: KVLayoutSpec, copied_first: int, num_blocks: int
    ) -> None:
        t0 = time.perf_counter()
        leg.result["num_blocks"] = num_blocks  # the prompt's whole blocks (first_block of them were held)
        try:
            deadline = time.monotonic() + max(out.deadline_at - time.time(), 0.01)
            first = max(copied_first, min(await self._held_at(leg), num_blocks))
            if first >= num_blocks or out.slot is None:  # it holds every block that travels
                leg.result.update(ok=True, wan_bytes=0, wan_seconds=0.0, first_block=min(first, num_blocks))
                self._count(leg, "shipped")
                return
            result = await self._send(out, leg, layout, copied_first, first, num_blocks, deadline)
            self._shipped(leg, result, first)
        except (PddlinkError, TimeoutError, ConnectionError, OSError) as exc:
            reason = f"{exc.code.name.lower()}: {exc.message}" if isinstance(exc, PddlinkError) else repr(exc)
            leg.result.update(ok=False, error=reason)
            metrics.TRANSFER_ABORTS.labels(reason=reason.split(":")[0]).inc()
            self._count(leg, "failed")
        finally:
            leg.result["ship_seconds"] = time.perf_counter() - t0
            if all(x.ship is not None and (x is leg or x.ship.done()) for x in out.legs.values()):
                self._finish(out)

    @staticmethod
    async def _held_at(leg: Destination) -> int:
        """The blocks the destination holds already (its reservation's answer); 0 when it could not
        say (then everything ships)."""
        assert leg.reservation is not None
        try:
            return await leg.reservation
        except PddlinkError as exc:
            leg.result["reserve_error"] = f"{exc.code.name.lower()}: {exc.message}"
            return 0

    async def _send(
        self,
        out: Outgoing,
        leg: Destination,
        layout: KVLayoutSpec,
        copied_first: int,
        first: int,
        num_blocks: int,
        deadline: float,
    ) -> TransferResult:
        """Ships blocks ``first``.. of ``out``'s slot to ``leg``'s destination; the transfer's result."""
        assert out.slot is not None
        slot = out.slot
        start = slot.offset + (first - copied_first) * out.per_block
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
        wan = leg.name == "md"  # the byte-plane codec is for the WAN; the fast path goes raw
        if wan:
            begin = dataclasses.replace(begin, codec=self.wan_codec.decide(layout.dtype, payload).codec)
        client = await leg.peer.client(deadline)
        flow = f"{out.transfer}/{begin.transfer_id}"
        if wan:
            self.wan_codec.started(flow, payload.nbytes, time.monotonic())
        result: TransferResult | None = None
        heard = client.stats().bytes_received
        try:
            left_s = max(deadline - time.monotonic(), 0.01)
            result = await client.send_transfer(begin, payload, deadline_s=left_s)
        except PddlinkError as exc:
            # only a link that is lost or stalled is closed, and only the client this transfer
            # ran on (KVPeer.send's rule): closing it for a transfer that was cancelled, or a
            # link re-dialled since, cancels every other transfer on it ("cancelled: link
            # closed"), and a consumer whose load had started then fails that request in vLLM
            if redial_after(exc, client, heard):
                await leg.peer.drop(client)
            raise
        finally:
            payload.release()
            if wan:
                self.wan_codec.finished(flow, layout.dtype, result, time.monotonic(), client.stats().rtt_s)
        assert result is not None
        return result

    def _shipped(self, leg: Destination, result: TransferResult, first: int) -> None:
        codec = result.codec.name.lower()
        leg.result.update(
            ok=True,
            wan_bytes=result.kv_bytes,  # KV before the codec; wire_bytes is what crossed
            wire_bytes=result.bytes,
            codec=codec,
            wan_seconds=result.seconds,
            first_block=first,
            transport=leg.peer.transport_name,
        )
        path = "wan" if leg.name == "md" else "fast"
        metrics.KV_BYTES.labels(path=path).inc(result.kv_bytes)
        metrics.KV_WIRE_BYTES.labels(path=path, codec=codec).inc(result.bytes)
        metrics.KV_CODEC_RAW_BYTES.labels(path=path, codec=codec).inc(result.kv_bytes)
        self._count(leg, "shipped", result.kv_bytes)

    def _count(self, leg: Destination, what: str, kv_bytes: int = 0) -> None:
        for counts in (self.leg_counts[leg.name], self.instance_counts.get(leg.instance)):
            if counts is not None:
                counts[what] += 1
                counts["bytes"] += kv_bytes

    def engine_lost(self, reason: str) -> int:
        """vLLM died (``reason``): every transfer it had not committed ends (its reservations
        cancelled, its slot freed); committed ones ship from the region on and end by themselves.
        How many ended."""
        for event in self._prepared.values():  # an ALLOC waiting for its PREPARE: it never comes
            event.set()
        gone = [t for t, out in self.out.items() if not out.committed]
        for t in gone:
            self._release(t, f"engine lost: {reason}")
        return len(gone)

    def _release(self, transfer: str, reason: str) -> None:
        out = self.out.get(transfer)
        if out is None or out.committed:
            return  # unknown, or already shipping (the ship tasks free it)
        for leg in out.legs.values():
            if leg.reservation is not None:
                leg.reservation.cancel()
            leg.result.update(ok=False, error=f"released: {reason}")
        self._finish(out, released=True)

    def _finish(self, out: Outgoing, *, released: bool = False) -> None:
        if out.slot is not None:
            self.region.free(out.slot)
            out.slot = None
        self.out.pop(out.transfer, None)
        legs = {name: leg.result for name, leg in out.legs.items()}
        ok = all(r.get("ok") for r in legs.values())
        key = "released" if released else "shipped" if ok else "failed"
        self.counts[key] += 1
        top = legs.get("md") or next(iter(legs.values()))
        self._record(out.transfer, {**top, "ok": ok, "legs": legs})

    def _record(self, transfer: str, record: dict[str, Any]) -> None:
        self.done[transfer] = record
        while len(self.done) > 10_000:
            self.done.pop(next(iter(self.done)))

    def status(self) -> dict[str, Any]:
        return {
            "region": str(self.region.path),
            "held_slots": self.region.held_slots,
            "held_bytes": self.region.held_bytes,
            "in_flight": len(self.out),
            "legs": {name: dict(c) for name, c in self.leg_counts.items()},
            **({"instances": {n: dict(c) for n, c in self.instance_counts.items()}} if self.named else {}),
            **self.counts,
        }

    def result(self, transfer: str) -> dict[str, Any] | None:
        """A finished transfer's record (``{"ok", ..., "legs": {...}}``), None while in flight."""
        return self.done.get(transfer)

    async def close(self) -> None:
        tasks = [
            t for o in self.out.values() for leg in o.legs.values() for t in (leg.reservation, leg.ship) if t
        ]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
