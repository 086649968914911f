"""Deadlines for everything a sidecar holds, enforced by one periodic sweep; and the engine watch.

What a sidecar keeps between calls, and what ends it when nobody else does:

    decoder entry (RLD, MD)   its request's deadline (Attach gives it; one made by a KV transfer or
                              a slice before any Attach has the decoder's orphan deadline)
                              -> ended (engine and DRC released, waiters woken), then forgotten
    orphan entry              never attached ``orphan_s`` after the sweep first saw it, or made for
                              a request that already ended here (a late transfer): ended at once
    DRC reservation (MD)      its lease (``PrefixIndex.handle_timer``); released at once when its
                              request already ended here (a Reserve that arrived late, or whose
                              transfer never came)

``verdict`` decides per entry (pure, time passed in); ``Sweeper`` runs it every ``interval_s``,
applies it through the decoder, expires DRC leases in the engine thread, and publishes what is
held (``held()``: ``/status`` and the ``pddlink_sidecar_held`` gauge), so a test can watch every
count drop to 0 once the load ends. It also watches the engine: when an engine process dies, the
sidecar reports it (``/healthz`` and ``/readyz`` 503) and stops, so it leaves the pool and its
supervisor restarts it (``on_engine_dead``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pddlink import metrics
from pddlink.errors import ConfigError, PddlinkError
from pddlink.lifecycle import StreamClosed, StreamEnd
from pddlink.serving.malloc_trim import TRIM_EVERY_S, release

log = logging.getLogger(__name__)


class Verdict(Enum):
    KEEP = "keep"
    END = "end"  # still open: close it (releases what it holds, wakes its waiters), then forget it
    FORGET = "forget"  # already ended: drop the entry (and the KV chunks it may still hold)


@dataclass(frozen=True, slots=True)
class HeldEntry:
    """What the sweep needs to know of one decoder entry."""

    request_id: str
    deadline: float
    attached: bool  # an Attach gave it a prompt and its real deadline
    ended: bool
    ended_before: bool  # this id already ended here: nothing will attach to it again


@dataclass(frozen=True, slots=True)
class SweepPolicy:
    interval_s: float = 1.0
    grace_s: float = 1.0  # past its deadline by this much (an attached stream ends itself at it)
    orphan_s: float = 5.0  # not attached for this long: its Attach is not coming

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.grace_s < 0 or self.orphan_s <= 0:
            raise ConfigError("sweep: interval_s > 0, grace_s >= 0, orphan_s > 0")


def verdict(entry: HeldEntry, now: float, unattached_for_s: float, policy: SweepPolicy) -> Verdict:
    """What to do with ``entry`` at ``now``; ``unattached_for_s``: since the sweep first saw it so."""
    overdue = now > entry.deadline + policy.grace_s
    orphaned = not entry.attached and (entry.ended_before or unattached_for_s >= policy.orphan_s)
    if not (overdue or orphaned):
        return Verdict.KEEP
    return Verdict.FORGET if entry.ended else Verdict.END


@dataclass(frozen=True, slots=True)
class Held:
    """Entries a sidecar holds now (all 0 on an idle sidecar once the sweep has run)."""

    requests: int = 0  # decoder entries, open or ended but not yet forgotten
    waiting_kv: int = 0  # open decoder entries whose KV is not imported yet
    reservations: int = 0  # DRC leases (MD)

    def as_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "waiting_kv": self.waiting_kv, "reservations": self.reservations}


class DecoderEntries:
    """The sweep's view of ``sidecar.decoder.Decoder`` (the one place that knows its fields)."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def entries(self) -> list[HeldEntry]:
        d = self.decoder
        return [
            HeldEntry(rid, slot.seq.deadline, bool(slot.seq.prompt), slot.seq.ended, rid in d.ended_recently)
            for rid, slot in list(d.slots.items())
        ]

    def counts(self) -> tuple[int, int]:
        status = self.decoder.status()
        return len(self.decoder.slots), int(status["waiting_kv"])

    async def end(self, request_id: str) -> None:
        slot = self.decoder.slots.get(request_id)
        if slot is None:
            return
        seq = slot.seq
        seq.kv = None  # the chunks of a transfer nobody will import
        if not seq.ended:
            await self.decoder.end(slot, StreamClosed(StreamEnd.FAILED, "deadline_exceeded"))
        if not slot.imported.is_set():  # a slice waiting for the import: refuse it now
            seq.import_error = seq.import_error or "expired: the request's deadline passed"
            slot.imported.set()
        self.forget(request_id)

    def ended_ids(self) -> set[str]:
        """Requests that ended here and hold no entry any more."""
        return set(self.decoder.ended_recently) - set(self.decoder.slots)

    def forget(self, request_id: str) -> None:
        d = self.decoder
        slot = d.slots.pop(request_id, None)
        if slot is not None:
            slot.seq.kv = None
            late = StreamClosed(StreamEnd.FAILED, "deadline_exceeded")
            d.ended_recently.setdefault(request_id, slot.seq.closed or late)


RunInEngine = Callable[..., Awaitable[Any]]  # EngineLoop.call


def release_ended(drc: Any, ended: set[str]) -> int:
    """Engine thread: drop the reservations of requests that already ended; returns how many."""
    gone = [rid for rid in drc.index.reserved() if rid in ended]
    for rid in gone:
        drc.release(rid)
    return len(gone)


class Sweeper:
    def __init__(
        self,
        *,
        decoder: Any = None,
        drc: Any = None,
        run_in_engine: RunInEngine | None = None,
        engine: Any = None,
        on_engine_dead: Callable[[str], None] | None = None,
        policy: SweepPolicy | None = None,
    ) -> None:
        self.entries = DecoderEntries(decoder) if decoder is not None else None
        self.drc, self.run_in_engine = drc, run_in_engine
        self.engine, self.on_engine_dead = engine, on_engine_dead
        self.policy = policy or SweepPolicy()
        self.first_unattached: dict[str, float] = {}
        self.swept: dict[str, int] = {"ended": 0, "forgotten": 0, "leases": 0, "leases_of_ended": 0}
        self.engine_dead = ""
        self.trims = 0  # malloc_trim calls that released memory
        self._task: asyncio.Task[None] | None = None

    async def sweep(self, now: float) -> None:
        if self.entries is not None:
            await self._sweep_entries(now)
        if self.drc is not None and self.run_in_engine is not None:
            ended = self.entries.ended_ids() if self.entries is not None else set()
            with contextlib.suppress(PddlinkError):
                expired = await self.run_in_engine("drc", self.drc.index.handle_timer, now)
                self._count("leases", len(expired))
                released = await self.run_in_engine("drc", release_ended, self.drc, ended)
                self._count("leases_of_ended", released)
        self._watch_engine()
        for kind, value in self.held().as_dict().items():
            metrics.SIDECAR_HELD.labels(kind=kind).set(value)

    async def _sweep_entries(self, now: float) -> None:
        assert self.entries is not None
        seen = self.first_unattached
        entries = self.entries.entries()
        live = {e.request_id for e in entries if not e.attached}
        for rid in list(seen):
            if rid not in live:
                del seen[rid]
        for e in entries:
            first = seen.setdefault(e.request_id, now) if not e.attached else now
            what = verdict(e, now, now - first, self.policy)
            if what is Verdict.END:
                await self.entries.end(e.request_id)
                self._count("ended", 1)
            elif what is Verdict.FORGET:
                self.entries.forget(e.request_id)
                self._count("forgotten", 1)
            if what is not Verdict.KEEP:
                seen.pop(e.request_id, None)

    def _count(self, kind: str, n: int) -> None:
        if n:
            self.swept[kind] += n
            metrics.SIDECAR_SWEPT.labels(kind=kind).inc(n)

    def _watch_engine(self) -> None:
        if self.engine_dead or bool(getattr(self.engine, "alive", True)):
            return
        self.engine_dead = "the engine process is gone"
        if self.on_engine_dead is not None:
            self.on_engine_dead(self.engine_dead)

    def held(self) -> Held:
        requests = waiting = reservations = 0
        if self.entries is not None:
            requests, waiting = self.entries.counts()
        if self.drc is not None:
            reservations = self.drc.index.stats().reservations
        return Held(requests, waiting, reservations)

    def status(self) -> dict[str, Any]:
        return {
            "held": self.held().as_dict(),
            "swept": dict(self.swept),
            "engine_dead": self.engine_dead,
            "malloc_trims": self.trims,
        }

    # -- the periodic task ---------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._forever(), name="state-sweep")

    async def _forever(self) -> None:
        next_trim = time.monotonic() + TRIM_EVERY_S
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                await self.sweep(time.monotonic())
            except PddlinkError as exc:  # one bad entry must not stop the sweeping
                log.warning("state sweep: %s", exc.message)
            if time.monotonic() >= next_trim:  # garbage cycles freed, KV buffers back to the OS
                next_trim = time.monotonic() + TRIM_EVERY_S  # (pddlink.serving.malloc_trim)
                self.trims += int(await release())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
