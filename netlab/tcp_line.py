"""The loopback relay's TCP connections on one direction of the link: a ``SharedLine`` on the loop.

Every connection crossing the direction is a flow of one ``TcpLine``. Its pump reads the sender's
socket only while the flow has room in the line's queue (so a full line slows the sender through
TCP flow control, as a real bottleneck's queue does), the line's timer puts the flows' bytes on
the line in turn at the link's rate, and each piece is written to the receiver once the link's
delay (and jitter, order kept) has passed, held while the link is cut. A receiver that stops
reading stops its own flow only, as its closed receive window would: its pump stops reading while
its writer waits for the receiver (or ``TCP_MAX_UNWRITTEN_BYTES`` of it are on the line or in
flight), and the line goes on serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from dataclasses import dataclass, field
from typing import Any

from netlab.model import DirectionModel, LinkModel
from netlab.profile import Profile
from netlab.shared_line import SharedLine

TCP_CHUNK_BYTES = 256 * 1024
TCP_MAX_UNWRITTEN_BYTES = 32 * 1024 * 1024  # per flow: on the line or in flight, not yet written
TCP_SEGMENT_BYTES = 1448
HEADER_BYTES = 52  # IPv4 + TCP with timestamps, charged on the line per segment
DEFAULT_QUEUE_BYTES = 4 * 1024 * 1024  # a profile without a queue bound
QUANTUM_S = 0.002  # a turn on the line lasts about this long (fewer timer wakeups at high rates) ...
MIN_QUANTUM_BYTES = 16 * 1024  # ... and carries at least this much
OUTAGE_POLL_S = 0.02
# the kernel's send buffer toward a receiver, fixed: autotuned, it grows to megabytes that a receiver
# which stopped reading would still take off the line (a real path holds its receive window only)
RELAY_SNDBUF_BYTES = 256 * 1024


def limit_send_buffer(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RELAY_SNDBUF_BYTES)


def line_settings(profile: Profile, direction: str) -> tuple[float, int, int]:
    """(rate in wire bytes/s, queue bytes, quantum bytes) of ``direction``'s line."""
    spec = profile.direction(direction)
    rate = spec.rate_mbit * 125_000.0
    quantum = max(MIN_QUANTUM_BYTES, int(rate * QUANTUM_S))
    queue = spec.queue_bytes or spec.queue_packets * (TCP_SEGMENT_BYTES + HEADER_BYTES) or DEFAULT_QUEUE_BYTES
    return rate, max(queue, 4 * quantum), quantum


def delay_model(profile: Profile, direction: str) -> DirectionModel:
    """The direction's delay and jitter (order kept) alone: what a byte stream shows of the rest."""
    spec = dataclasses.replace(
        profile.direction(direction),
        rate_mbit=0.0, loss=0.0, gilbert_elliott=None, reorder=0.0, duplicate=0.0, corrupt=0.0,
        jitter_reorders=False, queue_packets=0, queue_bytes=0,
    )  # fmt: skip
    return DirectionModel(spec, direction, profile.seed)


@dataclass(eq=False, slots=True)
class _Flow:
    buf: bytearray = field(default_factory=bytearray)  # read, not yet on the line
    out: asyncio.Queue[tuple[float, bytes]] = field(default_factory=asyncio.Queue)  # (due, piece)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    unwritten: int = 0  # on the line or delayed, not yet written to the receiver
    blocked: bool = False  # the receiver's side is full: read no more of the sender


class TcpLine:
    """One direction's line, shared by every TCP connection the relay carries that way."""

    def __init__(self, model: LinkModel, direction: str, loop: asyncio.AbstractEventLoop) -> None:
        self.model, self.direction, self.loop = model, direction, loop
        self._profile = model.profile
        self.line = SharedLine(*self._settings())
        self._delay = delay_model(self._profile, direction)
        self._flows: dict[int, _Flow] = {}
        self._timer: asyncio.TimerHandle | None = None

    def _settings(self) -> tuple[float, int, int, int, int]:
        return (*line_settings(self._profile, self.direction), TCP_SEGMENT_BYTES, HEADER_BYTES)

    async def pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Carry ``src``'s bytes to ``dst`` over the line until ``src`` ends, then end ``dst``."""
        fid = self.line.open()
        flow = self._flows[fid] = _Flow()
        writer = asyncio.ensure_future(self._write(flow, dst))
        try:
            while data := await src.read(await self._room(fid, flow)):
                flow.buf += data
                unoffered = len(data)
                while unoffered:  # the room may have shrunk while the read waited
                    n = min(unoffered, await self._room(fid, flow))
                    self.line.offer(fid, n, self.loop.time())
                    unoffered -= n
                    self._tick()
            while self.line.pending(fid):
                flow.wake.clear()
                await flow.wake.wait()
            flow.out.put_nowait((0.0, b""))
            await writer
        finally:
            writer.cancel()
            self.line.close(fid)
            del self._flows[fid]

    async def _room(self, fid: int, flow: _Flow) -> int:
        while True:
            if not flow.blocked and flow.unwritten < TCP_MAX_UNWRITTEN_BYTES:
                room = self.line.room(fid)
                if room:
                    return min(room, TCP_CHUNK_BYTES)
                self.line.want(fid)
            flow.wake.clear()
            await flow.wake.wait()

    def _tick(self) -> None:
        """Put what is due on the line, hand each piece to its writer, re-arm the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.model.profile is not self._profile:  # a new profile, set through the control socket
            self._profile = self.model.profile
            self.line.configure(*self._settings())
            self._delay = delay_model(self._profile, self.direction)
        now = self.loop.time()
        cut = self.model.is_cut(self.direction, now)
        for sent in self.line.advance(now, cut):
            flow = self._flows[sent.flow]
            piece = bytes(flow.buf[: sent.nbytes])
            del flow.buf[: sent.nbytes]
            (fate,) = self._delay.admit(sent.leave_s, 1, sent.nbytes, False)
            flow.unwritten += sent.nbytes
            flow.out.put_nowait((fate.at_s, piece))
        for f in self._flows.values():
            f.wake.set()  # room may have freed, or a pump waits for its flow to empty
        nxt = now + OUTAGE_POLL_S if cut and self.line.backlogged else self.line.next_s()
        if nxt is not None:
            self._timer = self.loop.call_at(nxt, self._tick)

    async def _write(self, flow: _Flow, dst: Any) -> None:
        while True:
            at_s, piece = await flow.out.get()
            if not piece:
                if dst.can_write_eof():
                    with contextlib.suppress(OSError):
                        dst.write_eof()
                return
            await asyncio.sleep(max(0.0, at_s - self.loop.time()))
            while self.model.is_cut(self.direction, self.loop.time()):
                await asyncio.sleep(OUTAGE_POLL_S)
            dst.write(piece)
            flow.unwritten -= len(piece)
            flow.blocked = True  # while the receiver's side is full (it stopped reading)
            await dst.drain()
            flow.blocked = False
            flow.wake.set()


__all__ = ["TCP_CHUNK_BYTES", "TcpLine", "limit_send_buffer", "line_settings"]
