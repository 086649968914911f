"""The router's DRC mirrors: each follows one MD instance's own DRC event stream (one
``MirrorFollower`` per MD of the topology) so that per-request choices read a local copy
(``Mirror``) and never wait on any MD. A reference P publishes its own prefix cache the same way,
and the router follows each P too (placement prefers the P that holds a prompt); a P that answers
``UNIMPLEMENTED`` (an older one) is asked again every ``UNIMPLEMENTED_RETRY_S``, its mirror empty
and its match unknown meanwhile (``block_tokens()`` None).

The first message of each stream is a snapshot (it also gives the block size and the hash root);
events follow. A gap the mirror cannot bridge, or MD going away, ends the stream; the follower
reconnects shortly and starts again from a snapshot.

``VllmMirror`` is the same view for vLLM's MD: MD vLLM's own KV-cache events replayed into a local
``PrefixIndex`` (the feed MD's vLLM sidecar uses, ``pddlink.connector.kv_events``). A ZMQ
subscriber connects to a path or port where nothing publishes without a word, so the mirror would
stay empty and every request look like a miss (issue 27, item 5): ``PublisherWatch`` follows the
subscription's connection (a ZMQ socket monitor on a second subscriber that asks for no topic)
and, when no publisher has been connected for ``PUBLISHER_BOUND_S``, the mirror's ``problem()``
says so: the router's /readyz answers 503, /status carries it, and the metric
``pddlink_router_kv_events_publisher_up{instance}`` is 0.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from pddlink import metrics
from pddlink.connector.kv_events import KvEventFeed
from pddlink.drc import Mirror, PrefixIndex, decode_event, decode_snapshot
from pddlink.kv.hashing import BlockHasher
from pddlink.serving.pb import pb2

RECONNECT_S = 0.5
UNIMPLEMENTED_RETRY_S = 30.0  # a sidecar without a DRC (an older P): ask again this seldom
PUBLISHER_BOUND_S = 5.0  # no KV-event publisher connected this long: the mirror is broken
_NO_TOPIC = b"pddlink-probe: no topic"  # the probe's subscription: the publisher sends it nothing


class MirrorFollower:
    def __init__(self, md: Any) -> None:
        self.md = md
        self.mirror = Mirror(gap_timeout_s=2.0)
        self.hasher: BlockHasher | None = None
        self.root = 0
        self.last_error = ""  # why the DRC event stream from MD last broke

    async def follow(self) -> None:
        while True:
            try:
                async for batch in self.md.DrcEvents(pb2.DrcEventsRequest()):
                    self._apply(batch, time.monotonic())
                    if self.mirror.needs_resync:
                        break  # reconnect: the first message of a new stream is a snapshot
            except grpc.aio.AioRpcError as exc:  # MD restarting or unreachable: follow again shortly
                self.last_error = f"{exc.code().name}: {exc.details()}"
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    await asyncio.sleep(UNIMPLEMENTED_RETRY_S)
            await asyncio.sleep(RECONNECT_S)

    def _apply(self, batch: Any, now: float) -> None:
        if batch.snapshot:
            snap = decode_snapshot(batch.snapshot)
            if self.hasher is None or snap.root != self.root:
                self.root = snap.root
                self.hasher = BlockHasher("router", max(1, snap.block_size))
            self.mirror.load_snapshot(snap, now)
        for data in batch.events:
            self.mirror.apply(decode_event(data), now)

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        if self.hasher is None:
            return 0
        hashes = self.hasher.hash_blocks(list(prompt), parent=self.root)
        return self.mirror.match(hashes).matched_blocks * self.hasher.block_size

    def blocks(self) -> int:
        return len(self.mirror)

    def block_tokens(self) -> int | None:
        """The instance's block size (from its first snapshot; None before)."""
        return None if self.hasher is None else self.hasher.block_size

    def status(self, now: float) -> dict[str, Any]:
        st = self.mirror.staleness(now)
        return {
            "blocks": len(self.mirror),
            "epoch": st.epoch,
            "applied_seq": st.applied_seq,
            "seq_lag": st.seq_lag,
            "needs_resync": st.needs_resync,
            "last_error": self.last_error,
        }


class PublisherWatch:
    """Whether a publisher is connected at a ZMQ endpoint, and since when it is not."""

    def __init__(self, endpoint: str, now: float, instance: str = "md0") -> None:
        self.endpoint = endpoint
        self.up = metrics.KV_EVENTS_PUBLISHER_UP.labels(instance=instance)
        self.connected = False
        self.since = now  # of the last change (start: not connected)
        self.connects = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def problem(self, now: float) -> str:
        down_s = now - self.since
        if self.connected or down_s < PUBLISHER_BOUND_S:
            return ""
        return (
            f"no vLLM KV-event publisher at {self.endpoint} (an MD's kv_events; [vllm] md_kv_events) "
            f"for {down_s:.0f} s: "
            "the DRC mirror is empty and every request looks like a cache miss (does MD's vLLM "
            "--kv-events-config publish there?)"
        )

    def _set(self, connected: bool, now: float) -> None:
        if connected != self.connected:
            self.connected, self.since = connected, now
            self.connects += connected
        self.up.set(1 if connected else 0)

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import parse_monitor_message

        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, _NO_TOPIC)
        sock.setsockopt(zmq.LINGER, 0)
        up, down = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED
        monitor = sock.get_monitor_socket(up | down)
        sock.connect(self.endpoint)
        self.up.set(0)
        try:
            while True:
                ev = parse_monitor_message(await monitor.recv_multipart())
                self._set(ev["event"] == up, time.monotonic())
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()
            ctx.term()


class VllmMirror(KvEventFeed):
    """The router's mirror of MD's vLLM prefix cache, fed by MD vLLM's own KV-cache events (a second
    subscriber on its ZMQ publisher, beside MD's sidecar; ``pddlink.connector.kv_events``).

    It never answers a longer prefix than MD holds: blocks stored before it subscribed are orphans
    (not indexed, a shorter answer), and whatever may have been missed clears it: a gap in the
    publisher's sequence numbers (lost batches, or a restarted vLLM counting from 0 again) and MD
    found dead (``forget_all``, told by the backend's health watch). The block size is vLLM's own,
    learnt from the events (until the first one the mirror matches nothing)."""

    def __init__(self) -> None:
        super().__init__(PrefixIndex(), model_id="router-md-mirror", block_size=1)
        self.learnt = False  # block_size is vLLM's (from an event), not the placeholder
        self.endpoint = ""
        self._gaps_seen = 0
        self.resets = 0
        self.watch: PublisherWatch | None = None

    def start(self, endpoint: str, instance: str = "md0") -> None:
        """Subscribe at ``endpoint``, MD ``instance``'s publisher (the name labels its metric)."""
        self.endpoint = endpoint
        super().start(endpoint)
        self.watch = PublisherWatch(endpoint, time.monotonic(), instance)
        self.watch.start()

    async def close(self) -> None:
        if self.watch is not None:
            await self.watch.close()
        await super().close()

    def problem(self) -> str:
        """Why the mirror cannot be trusted now ("" when it can): no publisher at the endpoint."""
        return self.watch.problem(time.monotonic()) if self.watch is not None else ""

    def apply(self, events: list[Any]) -> None:
        if self.counts["gaps"] != self._gaps_seen:
            self._gaps_seen = self.counts["gaps"]
            self.forget_all()
        super().apply(events)

    def _stored(self, ev: Any, now: float) -> None:
        if ev.block_size and (not self.learnt or ev.block_size != self.block_size):
            self.forget_all()  # (first event) vLLM's block size: what the prompts are cut into
            self.block_size, self.learnt = int(ev.block_size), True
            self.hasher = BlockHasher("router-md-mirror", self.block_size)
        super()._stored(ev, now)

    def forget_all(self) -> None:
        if len(self.index) or self._ours:
            self.resets += 1
        self._ours.clear()
        self.index.clear(time.monotonic())

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        if not self.learnt or len(prompt) < self.block_size:
            return 0
        hashes = self.hasher.hash_blocks(list(prompt))
        return self.index.match(hashes).matched_blocks * self.block_size

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        watch = self.watch
        return {
            "source": f"md's vLLM KV events at {self.endpoint}",
            "publisher_connected": watch.connected if watch is not None else None,
            "last_batch_age_s": round(now - self.last_event_at, 1) if self.last_event_at else None,
            "problem": self.problem(),
            "block_size": self.block_size if self.learnt else None,
            "resets": self.resets,
            **self.stats(),
        }
