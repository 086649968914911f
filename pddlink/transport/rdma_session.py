"""Transport "rdma": a TCP link whose chunks move by RDMA writes once both sides set RDMA up.

The link is ``tcp``'s: the same control connection, TLS, hello and identity checks. Both sides
offer ``rdma/1`` in the hello; after it, ``FastPathSetup`` drives ``pddlink.wire.rdma_setup`` on
the control connection: the receiver (the listening RelayDecode side) sends its queue-pair
endpoint, the sender answers with its own, each connects its queue pair (``rdma_fastpath``), and
chunks then go through an ``RdmaSendLane``/``RdmaReceiveLane`` (``rdma_lanes``) while acks,
begin/end and credits stay on the control connection. If either side lacks RDMA (no device, no
pyverbs, a verbs call failed), the peer does not offer ``rdma/1``, or set-up misses its deadline,
the link opens its TCP stripes instead: the reason goes to the log (once per reason and process, at
WARNING), to the ``pddlink_fallbacks`` metric (kind ``rdma_<reason>``), to ``link.fast_path`` and
to ``LinkStats`` (transport "tcp", ``extra["rdma"] = 0``). A later RDMA failure (a failed
completion, a peer's decline, the control connection lost with slot credits in flight, a poll task
that died) drops the RDMA lane, opens the stripes (a refused dial is retried with the reconnect
backoff), and running transfers resume there. The link does not go back to RDMA afterwards (a new
link does). The receiver cannot tell a peer's clean close from a cut control connection: it drops
its lane at once but reports the failure only if the peer reconnects (a close is no fallback).
Whatever fails inside the fast path (a provider or pyverbs raising anything) costs RDMA, never the
link: ``connect`` returns a working link or raises a ``PddlinkError``.

Lifecycle: ``RdmaTransport.connect`` returns once the path is decided (at most the set-up timeout
after the hello); ``RdmaTransport.listen`` decides per accepted link, in the background.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, ClassVar, NoReturn

from pddlink.errors import ErrorCode, LocalError, PddlinkError, Unavailable
from pddlink.transport.base import Handlers, LinkOptions, LinkStats, Message
from pddlink.transport.framing import FrameConnection
from pddlink.transport.rdma import RdmaConfig
from pddlink.transport.rdma_fastpath import VERBS, FastPathSetup, RdmaProvider, describe
from pddlink.transport.rdma_lanes import Channel, RdmaReceiveLane, RdmaSendLane
from pddlink.transport.receiving import ReceivingSession
from pddlink.transport.registry import FastPathChoice
from pddlink.transport.tcp import Dial, TcpLink, TcpListener, serve
from pddlink.transport.tcp_conn import SESSION_CAP, Inbox
from pddlink.transport.tls import PeerIdentity, TlsConfig
from pddlink.transport.transfers import Lanes
from pddlink.wire import (
    RDMA_CAPABILITY,
    ChannelRole,
    RdmaCredit,
    RdmaDecline,
    RdmaReady,
    RdmaSetup,
)
from pddlink.wire.rdma_setup import Fallback, FastPathSelected, SetupConfig

log = logging.getLogger(__name__)
SETUP_MESSAGES = (RdmaSetup, RdmaReady, RdmaDecline)
CONTROL_LOST = "control connection lost (slot credits in flight may be lost with it)"


def on_path(snap: LinkStats, lane_counters: dict[str, int] | None) -> LinkStats:
    """A link's stats labelled with the path its chunks take: ``lane_counters`` are the RDMA lane's
    (None: no RDMA lane, the chunks go by TCP)."""
    extra = {"rdma": 0.0 if lane_counters is None else 1.0}
    extra |= {name: float(value) for name, value in (lane_counters or {}).items()}
    return dataclasses.replace(snap, transport="tcp" if lane_counters is None else "rdma", extra=extra)


def stop_lane(lane: RdmaSendLane | RdmaReceiveLane, lane_id: int | None, lanes: Lanes) -> None:
    """Stop an RDMA lane and take it out of the link's lanes."""
    lane.stop()
    if lane_id is not None:
        lanes.remove(lane_id)


class RdmaLink(TcpLink):
    """The connecting (sending) side: TCP link plus, once set up, an RDMA lane for chunks."""

    transport_name = "rdma"

    def __init__(
        self,
        peer: PeerIdentity,
        handlers: Handlers,
        dial: Dial,
        options: LinkOptions,
        *,
        provider: RdmaProvider,
        peer_offers: bool,
        timeout_s: float,
    ) -> None:
        super().__init__(peer, handlers, dial, options)
        self._lane: RdmaSendLane | None = None
        self._lane_id: int | None = None
        self.setup = FastPathSetup(
            ChannelRole.SENDER, peer, peer_offers=peer_offers, provider=provider, options=options,
            send=self.send_control, on_path=self._on_path, timeout_s=timeout_s,
        )  # fmt: skip

    @property
    def fast_path(self) -> FastPathChoice | None:
        return self.setup.choice

    async def start_fast_path(self) -> FastPathSelected:
        """Run the set-up to its decision (bounded by its deadline), then open what it chose."""
        self.setup.start()
        bound_s = self.setup.machine.config.timeout_s + 1.0  # the machine's own deadline fires first
        try:
            outcome = await asyncio.wait_for(asyncio.shield(self.setup.decided), bound_s)
        except TimeoutError:
            raise LocalError("RDMA set-up never decided", code=ErrorCode.INTERNAL) from None
        if outcome.path == "tcp":
            await self.open_stripes()
        return outcome

    def on_control(self, message: Message) -> None:
        if isinstance(message, SETUP_MESSAGES):
            self.setup.receive(message)
        elif isinstance(message, RdmaCredit):
            if self._lane is not None:
                self._lane.credit(message.slots)
        else:
            super().on_control(message)

    def _on_path(self, outcome: FastPathSelected) -> None:
        channel, peer_endpoint = self.setup.channel, self.setup.machine.peer_endpoint
        if outcome.path == "rdma" and channel is not None and peer_endpoint is not None:
            self._lane = RdmaSendLane(channel, peer_endpoint, self.send_control, self.setup.lane_failed)
            self._lane_id = self.lanes.add(self._lane)
            self.spawn(self._lane.run())
        elif self._lane is not None:  # RDMA was in use: fall back to stripes, transfers resume there
            stop_lane(self._lane, self._lane_id, self.lanes)
            self._lane = None
            self.spawn(self._stripes_after_fallback())

    async def _stripes_after_fallback(self) -> None:
        """Open the TCP stripes; one whose dial fails is retried with the link's reconnect backoff
        (as a lost stripe is), so one refused dial cannot leave the link without lanes."""
        results = await asyncio.gather(
            *(self._open_stripe() for _ in range(self.options.streams)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, PddlinkError) and not self.closed:
                log.warning("opening a TCP stripe to %s failed: %s; retrying", self.peer, result.message)
                self.spawn(self._reconnect(control=False))
            elif isinstance(result, BaseException):
                raise result

    def _lost(self, conn: FrameConnection, lane_id: int | None) -> None:
        super()._lost(conn, lane_id)
        if lane_id is None and self._lane is not None and not self.closed:
            # slot credits in flight may be gone with it: RDMA cannot be trusted to keep flowing
            self.setup.lane_failed(CONTROL_LOST)

    def stats(self) -> LinkStats:
        lane = self._lane
        counters = None
        if lane is not None:
            counters = {"rdma_chunks": lane.chunks_written, "control_chunks": lane.chunks_on_control}
        return on_path(super().stats(), counters)

    async def close(self) -> None:
        if self._lane is not None:
            self._lane.stop()
        await super().close()
        self.setup.close_channel()


class RdmaReceivingSession(ReceivingSession):
    """The accepting (receiving) side of one link: TCP lanes plus, once set up, the RDMA lane."""

    def __init__(
        self,
        peer: PeerIdentity,
        handlers: Handlers,
        options: LinkOptions,
        *,
        provider: RdmaProvider,
        peer_offers: bool,
        timeout_s: float,
    ) -> None:
        super().__init__(peer, handlers, options, "rdma")
        self._lane: RdmaReceiveLane | None = None
        self._lane_id: int | None = None
        self._control_lost_under_rdma = False
        self.setup = FastPathSetup(
            ChannelRole.RECEIVER, peer, peer_offers=peer_offers, provider=provider, options=options,
            send=self.send_control, on_path=self._on_path, timeout_s=timeout_s,
        )  # fmt: skip

    @property
    def fast_path(self) -> FastPathChoice | None:
        return self.setup.choice

    def attach(self, conn: Any, inbox: Any, *, control: bool) -> None:
        super().attach(conn, inbox, control=control)
        if control and not self.setup.started:
            self.setup.start()
        elif control and self._control_lost_under_rdma:
            self._control_lost_under_rdma = False  # it came back: the loss was a failure
            self.setup.lane_failed(CONTROL_LOST)

    def on_control(self, message: Message) -> None:
        if isinstance(message, SETUP_MESSAGES):
            self.setup.receive(message)
        else:
            super().on_control(message)

    def _on_path(self, outcome: FastPathSelected) -> None:
        channel = self.setup.channel
        if outcome.path == "rdma" and channel is not None:
            lane = self._lane = RdmaReceiveLane(
                channel, self.send_control, self._deliver, self.setup.lane_failed
            )
            self._lane_id = self.lanes.add(lane)
            self.spawn(lane.run())
        elif self._lane is not None:
            stop_lane(self._lane, self._lane_id, self.lanes)
            self._lane = None

    def detach(self, lane_id: int) -> None:
        control_lost = self._control is not None and self._conns.get(lane_id) is self._control
        super().detach(lane_id)
        if control_lost and self._lane is not None and not self.closed:
            # No credit can flow until the peer reconnects the control connection. Whether this
            # was a failure is only known then: a peer that closed its link never comes back, and
            # a clean close is no RDMA failure (no metric, no warning).
            stop_lane(self._lane, self._lane_id, self.lanes)
            self._lane = None
            self._control_lost_under_rdma = True

    def _deliver(self, chunk: Message) -> None:
        if self._lane_id is not None:
            self.receive(chunk, self._lane_id)

    def stats(self) -> LinkStats:
        lane = self._lane
        return on_path(super().stats(), None if lane is None else {"rdma_chunks": lane.frames_received})

    async def close(self) -> None:
        if self._lane is not None:
            self._lane.stop()
        await super().close()
        self.setup.close_channel()


class RdmaListener(TcpListener):
    """A TCP listener that offers ``rdma/1`` and sets RDMA up on every link it accepts."""

    capabilities = (RDMA_CAPABILITY,)

    def __init__(
        self,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        handlers: Handlers,
        options: LinkOptions,
        *,
        provider: RdmaProvider,
        timeout_s: float,
    ) -> None:
        super().__init__(identity, tls, handlers, options)
        SetupConfig(timeout_s=timeout_s)  # a bad timeout is the caller's ConfigError, not a link's
        self.provider, self.timeout_s = provider, timeout_s

    def new_session(self, peer: PeerIdentity, control: Inbox) -> ReceivingSession:
        offers = RDMA_CAPABILITY in control.capabilities
        try:
            return self._session(peer, self.provider, offers)
        except Exception as exc:  # never lose the link (or the greeting task) over its fast path
            log.exception("RDMA set-up for %s failed; the link goes on over TCP", peer)
            return self._session(peer, unavailable(f"RDMA set-up failed: {describe(exc)}"), offers)

    def _session(self, peer: PeerIdentity, provider: RdmaProvider, offers: bool) -> RdmaReceivingSession:
        return RdmaReceivingSession(
            peer, self.handlers, self.options, provider=provider, peer_offers=offers,
            timeout_s=self.timeout_s,
        )  # fmt: skip


class RdmaTransport:
    """Registry entry "rdma" (see the module docstring). ``provider`` and ``setup_timeout_s`` are
    class attributes so a subclass can change them (tests: a memory channel)."""

    name: ClassVar[str] = "rdma"
    provider: ClassVar[RdmaProvider] = VERBS
    setup_timeout_s: ClassVar[float] = 5.0

    @classmethod
    async def listen(
        cls,
        host: str,
        port: int,
        *,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        handlers: Handlers,
        options: LinkOptions,
    ) -> RdmaListener:
        listener = RdmaListener(
            identity, tls, handlers, options, provider=cls.provider, timeout_s=cls.setup_timeout_s
        )
        return await serve(listener, host, port, tls)

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        expected_peer: PeerIdentity | None,
        handlers: Handlers,
        options: LinkOptions,
    ) -> RdmaLink:
        dial = Dial(host, port, identity, tls, expected_peer, options)
        dial.capabilities = (RDMA_CAPABILITY,)
        conn, inbox, peer = await dial(SESSION_CAP)
        dial.expected_peer = peer
        try:
            link = RdmaLink(
                peer, handlers, dial, options, provider=cls.provider,
                peer_offers=RDMA_CAPABILITY in inbox.capabilities, timeout_s=cls.setup_timeout_s,
            )  # fmt: skip
        except BaseException as exc:
            conn.close()  # the control connection must not outlive a link that never was
            raise_typed(exc)
        link.adopt_control(conn, inbox)
        try:
            await link.start_fast_path()
        except BaseException as exc:
            await link.close()
            raise_typed(exc)
        return link


def raise_typed(exc: BaseException) -> NoReturn:
    """Re-raise ``exc`` if it is typed (or a cancellation), else a ``LocalError`` naming it."""
    if isinstance(exc, PddlinkError) or not isinstance(exc, Exception):
        raise exc
    raise LocalError(f"RDMA link set-up failed: {describe(exc)}", code=ErrorCode.INTERNAL) from exc


def unavailable(reason: str) -> RdmaProvider:
    """A provider that has no RDMA, for ``reason``."""

    def refuse(role: ChannelRole, config: RdmaConfig) -> Channel:
        raise Unavailable(reason)

    return RdmaProvider(lambda: (False, reason), refuse)


__all__ = ["Fallback", "RdmaLink", "RdmaListener", "RdmaProvider", "RdmaReceivingSession", "RdmaTransport"]
