"""Setting RDMA up on one link: the asyncio driver of ``pddlink.wire.rdma_setup``.

``FastPathSetup`` is created when a link's hello has passed (knowing whether the peer offers
``rdma/1``): it opens this side's channel if the peer offers and this host can (``RdmaProvider``:
verbs by default), feeds the set-up machine the control messages, connects the queue pair when the
machine asks, arms its deadline timer, and reports each decision: ``on_path`` for the link, the log
(once per reason and process), and the ``pddlink_fallbacks`` metric (kind ``rdma_<reason>``).
It owns the channel until the path turns to TCP or the link closes (``close_channel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pddlink import metrics
from pddlink.errors import PddlinkError
from pddlink.transport.base import LinkOptions, Message
from pddlink.transport.machine_timer import MachineTimer
from pddlink.transport.rdma import RdmaChannel, RdmaConfig, RdmaError, rdma_available
from pddlink.transport.rdma_lanes import Channel
from pddlink.transport.registry import FastPathChoice
from pddlink.transport.tls import PeerIdentity
from pddlink.wire import HEADER_BYTES, ChannelRole, RdmaEndpoint
from pddlink.wire.rdma_setup import (
    ConnectQueuePair,
    FastPathSelected,
    LocalRdma,
    RdmaNegotiation,
    SetupConfig,
)

log = logging.getLogger(__name__)
FRAME_HEADROOM = 4096  # slot bytes beyond chunk_bytes: the chunk frame's header and body
_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class RdmaProvider:
    """Where channels come from: verbs by default; tests give a memory pair (no device here)."""

    available: Callable[[], tuple[bool, str]]
    open_channel: Callable[[ChannelRole, RdmaConfig], Channel]


VERBS = RdmaProvider(rdma_available, RdmaChannel)


def describe(exc: BaseException) -> str:
    """A failure as a reason: a typed error's message, else its type and text."""
    return exc.message if isinstance(exc, PddlinkError) else f"{type(exc).__name__}: {exc}"


def channel_config(options: LinkOptions) -> RdmaConfig:
    """Slots sized for the link's chunks; as many as the transfer window holds (at most 64)."""
    slots = max(1, min(64, options.window_bytes // options.chunk_bytes))
    return RdmaConfig(slots=slots, slot_bytes=options.chunk_bytes + FRAME_HEADROOM)


def report(peer: PeerIdentity, outcome: FastPathSelected) -> None:
    """Log a decision (first time per reason: INFO for RDMA, WARNING for TCP) and count fallbacks."""
    if outcome.fallback is not None:
        metrics.FALLBACKS.labels(kind=f"rdma_{outcome.fallback.value}").inc()
    key = (outcome.path, outcome.fallback.value if outcome.fallback else "")
    first = key not in _logged
    _logged.add(key)
    level = (logging.INFO if outcome.fallback is None else logging.WARNING) if first else logging.DEBUG
    log.log(level, "fast path to %s: %s (%s)", peer, outcome.path, outcome.reason)


class FastPathSetup:
    """Drives one link's ``RdmaNegotiation`` on the event loop; owns the channel until it is closed."""

    def __init__(
        self,
        role: ChannelRole,
        peer: PeerIdentity,
        *,
        peer_offers: bool,
        provider: RdmaProvider,
        options: LinkOptions,
        send: Callable[[Message], object],
        on_path: Callable[[FastPathSelected], None],
        timeout_s: float,
    ) -> None:
        self.peer, self._send, self._on_path = peer, send, on_path
        self.channel: Channel | None = None
        self._timer = MachineTimer(self._on_timer)
        self._started = False
        local = self._open(role, provider, options) if peer_offers else None
        min_slot = options.chunk_bytes + HEADER_BYTES + 64
        self.machine = RdmaNegotiation(
            role,
            peer_offers=peer_offers,
            local=local or LocalRdma.unavailable("not opened: the peer does not offer RDMA"),
            now=time.monotonic(),
            config=SetupConfig(timeout_s=timeout_s, min_slot_bytes=min_slot),
        )
        self.decided: asyncio.Future[FastPathSelected] = asyncio.get_running_loop().create_future()

    def _open(self, role: ChannelRole, provider: RdmaProvider, options: LinkOptions) -> LocalRdma:
        """This side's endpoint, or why there is none. Any failure of the provider (a verbs error,
        or anything a broken pyverbs raises) is a local one: the link goes on over TCP."""
        try:
            ok, reason = provider.available()
            if not ok:
                return LocalRdma.unavailable(f"RDMA fast path unavailable: {reason}")
            config = channel_config(options)
            self.channel = provider.open_channel(role, config)
            if role is ChannelRole.RECEIVER:
                self.channel.post_receives(config.slots)
            endpoint = self.channel.endpoint()
            if not isinstance(endpoint, RdmaEndpoint) or endpoint.role is not role:
                raise RdmaError(f"the channel's endpoint is not a {role.name} endpoint: {endpoint!r}")
            return LocalRdma(endpoint)
        except Exception as exc:
            self.close_channel()
            return LocalRdma.unavailable(f"RDMA channel could not be opened: {describe(exc)}")

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        self._started = True
        self._pump()

    def receive(self, message: Message) -> None:
        self.machine.receive(message, time.monotonic())
        self._pump()

    def lane_failed(self, reason: str) -> None:
        self.machine.local_failed(reason, time.monotonic())
        self._pump()

    def _pump(self) -> None:
        if not self._started:
            return  # messages fed before start() are answered at start()
        m = self.machine
        while True:
            for out in m.messages_to_send():
                with contextlib.suppress(PddlinkError):  # the control loss is the link's to handle
                    self._send(out)
            event = m.next_event()
            if event is None:
                break
            if isinstance(event, ConnectQueuePair):
                self._connect(event)
            else:
                self._decided(event)
        self._timer.arm(m.get_timer())

    def _connect(self, event: ConnectQueuePair) -> None:
        assert self.channel is not None
        try:
            self.channel.connect(event.peer)
        except Exception as exc:  # any failure here is this side's: decline, go on over TCP
            self.machine.local_failed(f"queue pair connect failed: {describe(exc)}", time.monotonic())
            return
        self.machine.endpoint_connected(time.monotonic())

    def _decided(self, outcome: FastPathSelected) -> None:
        report(self.peer, outcome)
        if outcome.path == "tcp":
            self.close_channel()
        if not self.decided.done():
            self.decided.set_result(outcome)
        self._on_path(outcome)

    def _on_timer(self, now: float) -> None:
        self.machine.handle_timer(now)
        self._pump()

    @property
    def choice(self) -> FastPathChoice | None:
        o = self.machine.outcome
        return None if o is None else FastPathChoice(o.path, o.reason, o.path == "rdma")

    def close_channel(self) -> None:
        self._timer.cancel()
        channel, self.channel = self.channel, None
        if channel is not None:
            try:
                channel.close()
            except Exception as exc:  # the link is leaving RDMA anyway; do not fail its close
                log.warning("closing the RDMA channel to %s failed: %s", self.peer, describe(exc))
