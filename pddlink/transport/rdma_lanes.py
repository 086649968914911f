"""The RDMA data path of one link: a sender lane and a receiver lane over a connected channel.

Both are *lanes* in the sense of ``transfers.py``: the transfer drivers send on them like on a TCP
stripe, so windows, acks, resume and integrity stay ``pddlink.transfer``'s.

- ``RdmaSendLane`` (connecting side): a ``Chunk`` is encoded as a frame and RDMA-written, with the
  slot index as immediate, into a free landing slot of the receiver; every other transfer message
  (begin, end, abort) goes on the control connection. A slot is free again when the receiver's
  ``RdmaCredit`` names it (a credit for a slot not in use is ignored and counted in
  ``stray_credits``); chunks wait in order for a slot (the transfer window bounds them). A chunk
  whose frame does not fit a slot goes on the control connection instead.
- ``RdmaReceiveLane`` (accepting side): each completion names a slot; the frame in it is decoded
  and handed to the session as if it had come on a stripe, and the slots read are credited back in
  one ``RdmaCredit`` per poll. Acks the transfer machine sends on this lane go on the control
  connection.

Each lane runs one poll task (``run``) on the event loop: a non-blocking CQ poll, then a sleep that
grows from 50 us to 2 ms while idle. A failed completion, an undecodable frame, or the poll task
ending any other way while the lane is live ends the lane: it reports ``on_failed(reason)`` and
the session falls back to TCP (the transfers resume there).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from pddlink.errors import PddlinkError
from pddlink.transport.base import Message
from pddlink.transport.framing import ConnectionLost
from pddlink.transport.rdma import RdmaCompletion, RdmaConfig
from pddlink.wire import Chunk, Decoder, RdmaCredit, RdmaEndpoint, WireError
from pddlink.wire.codec import encode_parts

log = logging.getLogger(__name__)
_IDLE_SLEEP_S = (0.00005, 0.002)  # first and longest sleep between empty polls


class Channel(Protocol):
    """What the lanes and the set-up need of ``rdma.RdmaChannel`` (tests run a memory one)."""

    config: RdmaConfig

    def endpoint(self) -> RdmaEndpoint: ...
    def connect(self, peer: RdmaEndpoint) -> None: ...
    def post_receives(self, count: int) -> None: ...
    def write_frame(self, slot: int, parts: Sequence[bytes | memoryview], imm: int) -> None: ...
    def poll_nowait(self, max_completions: int = 16) -> list[RdmaCompletion]: ...
    def read_slot(self, slot: int, length: int) -> bytes: ...
    def close(self) -> None: ...

    @property
    def in_flight(self) -> int: ...


Send = Callable[[Message], object]  # the link's send_control


class _PollingLane:
    def __init__(self, channel: Channel, control: Send, on_failed: Callable[[str], None]) -> None:
        self.channel = channel
        self._control = control
        self._on_failed = on_failed
        self._lost = False

    @property
    def lost(self) -> bool:
        return self._lost

    def stop(self) -> None:
        self._lost = True

    def fail(self, reason: str) -> None:
        if not self._lost:
            self._lost = True
            log.warning("RDMA lane failed: %s", reason)
            self._on_failed(reason)

    async def run(self) -> None:
        """The poll task. However it ends while the lane is live (a typed RDMA error, a bug, an
        unexpected exception from the channel or a handler), the lane fails and the link falls
        back to TCP: a dead poll task must never leave a registered lane whose chunks stall."""
        try:
            await self._poll()
        except asyncio.CancelledError:
            self.fail("the RDMA poll task was cancelled")
            raise
        except PddlinkError as exc:
            self.fail(exc.message)
        except Exception as exc:
            log.exception("RDMA poll task failed")
            self.fail(f"RDMA poll task failed: {type(exc).__name__}: {exc}")
        finally:
            self.fail("the RDMA poll task ended")  # no-op once stopped or failed

    async def _poll(self) -> None:
        idle = _IDLE_SLEEP_S[0]
        while not self._lost:
            done = self.channel.poll_nowait()
            if done:
                self.completions(done)
            idle = _IDLE_SLEEP_S[0] if done else min(idle * 2, _IDLE_SLEEP_S[1])
            await asyncio.sleep(0 if done else idle)

    def completions(self, done: list[RdmaCompletion]) -> None:
        raise NotImplementedError


class RdmaSendLane(_PollingLane):
    """Chunks by RDMA write into the peer's slots (see module docstring)."""

    def __init__(
        self, channel: Channel, peer: RdmaEndpoint, control: Send, on_failed: Callable[[str], None]
    ) -> None:
        super().__init__(channel, control, on_failed)
        self.window = min(channel.config.slots, peer.slots)
        self.slot_bytes = min(channel.config.slot_bytes, peer.slot_bytes)
        self._free: deque[int] = deque(range(self.window))
        self._in_use: set[int] = set()  # written, not yet credited back by the receiver
        self.stray_credits = 0  # credits for slots not in use (a confused or stale peer): ignored
        self._waiting: deque[tuple[bytes, bytes | memoryview]] = deque()
        self.chunks_written = 0
        self.chunks_on_control = 0

    def send(self, message: Message) -> int:
        if self._lost:
            raise ConnectionLost("the RDMA lane is down")
        if not isinstance(message, Chunk):
            self._control(message)
            return 0
        head, payload = encode_parts(message)
        size = len(head) + len(payload)
        if size > self.slot_bytes:
            self.chunks_on_control += 1
            self._control(message)
            return size
        self._waiting.append((head, payload))
        self._drain()
        return size

    def credit(self, slots: Sequence[int]) -> None:
        """The receiver read these slots: they may be written again."""
        for slot in slots:
            if slot in self._in_use:
                self._in_use.discard(slot)
                self._free.append(slot)
            else:
                self.stray_credits += 1
                log.debug("ignored a credit for RDMA slot %d: not in use", slot)
        self._drain()

    def completions(self, done: list[RdmaCompletion]) -> None:
        self._drain()  # each finished write freed a send-queue entry

    def _drain(self) -> None:
        while self._waiting and self._free and self.channel.in_flight < self.window and not self._lost:
            slot = self._free.popleft()
            head, payload = self._waiting.popleft()
            self._in_use.add(slot)  # from here on only its credit frees it
            try:
                self.channel.write_frame(slot, (head, payload), imm=slot)
            except PddlinkError as exc:
                self.fail(exc.message)
                return
            self.chunks_written += 1


class RdmaReceiveLane(_PollingLane):
    """Frames from the landing slots to the session; acks and credits on the control connection."""

    def __init__(
        self,
        channel: Channel,
        control: Send,
        deliver: Callable[[Message], None],
        on_failed: Callable[[str], None],
    ) -> None:
        super().__init__(channel, control, on_failed)
        self._deliver = deliver
        self.frames_received = 0

    def send(self, message: Message) -> int:
        if self._lost:
            raise ConnectionLost("the RDMA lane is down")
        self._control(message)
        return 0

    def completions(self, done: list[RdmaCompletion]) -> None:
        slots: list[int] = []
        for completion in done:
            if not completion.received:
                continue
            frame = self.channel.read_slot(completion.imm, completion.byte_len)
            slots.append(completion.imm)
            try:
                messages = Decoder(max_payload_bytes=len(frame)).feed(frame)
            except WireError as exc:
                self.fail(f"undecodable frame in RDMA slot {completion.imm}: {exc.message}")
                return
            if len(messages) != 1 or not isinstance(messages[0], Chunk):
                self.fail(f"RDMA slot {completion.imm} holds no single chunk frame")
                return
            self.frames_received += 1
            self._deliver(messages[0])
        if slots and not self._lost:
            self._control(RdmaCredit(tuple(slots)))
