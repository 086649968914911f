"""The packet path of the namespaced lab: two TUN devices, the link model between them.

``TunRelay`` reads bursts (super-packets with a virtio-net header) from each device, asks the model
for their fate and writes them to the other device when they are due. Due times sit in one heap;
the loop sleeps in ``select`` (microsecond timeouts, unlike epoll's milliseconds) until the next
packet is due or a device is readable. A burst whose segments share one fate is written whole; one
that a loss, queue overflow, reorder, duplicate or corruption hits is cut into runs of segments
sharing a fate, each written as a smaller super-packet (or a single wire packet).
"""

from __future__ import annotations

import heapq
import os
import random
from collections.abc import Callable

from netlab.model import Delivery, LinkModel
from netlab.segment import corrupt, cut
from netlab.tun import READ_BYTES, burst_shape

READ_BATCH = 64


class TunRelay:
    """Moves packets between the TUN devices of ``dc-a`` and ``dc-b`` through ``model``."""

    def __init__(self, model: LinkModel, fd_a: int, fd_b: int, clock: Callable[[], float]) -> None:
        self.model = model
        self.clock = clock
        self._route = {fd_a: ("a_to_b", fd_b), fd_b: ("b_to_a", fd_a)}
        self._heap: list[tuple[float, int, int, bytes]] = []
        self._seq = 0
        self._rng = random.Random(model.profile.seed)
        self.write_errors = 0
        self.released = 0  # packets released from the delay heap, and their total lateness
        self.lag_s_total = 0.0

    @property
    def fds(self) -> list[int]:
        return list(self._route)

    def timeout_s(self, now_s: float) -> float | None:
        return max(0.0, self._heap[0][0] - now_s) if self._heap else None

    def on_readable(self, fd: int) -> None:
        direction, out_fd = self._route[fd]
        admit = self.model.admit
        for _ in range(READ_BATCH):
            try:
                pkt = os.read(fd, READ_BYTES)
            except BlockingIOError:
                break
            now = self.clock()
            segments, wire_bytes = burst_shape(pkt)
            fates = admit(direction, now, segments, wire_bytes)
            if len(fates) == 1 and fates[0].count == segments and not fates[0].corrupt:
                self._send_at(fates[0].at_s, now, out_fd, pkt)
            elif fates:
                self._send_split(pkt, segments, fates, now, out_fd)

    def _send_split(self, pkt: bytes, segments: int, fates: list[Delivery], now: float, out_fd: int) -> None:
        for fate in fates:
            part = cut(pkt, fate.first, fate.count) if segments > 1 else pkt
            self._send_at(fate.at_s, now, out_fd, corrupt(part, self._rng) if fate.corrupt else part)

    def _send_at(self, at_s: float, now: float, out_fd: int, pkt: bytes) -> None:
        if at_s <= now and not self._heap:
            self._write(out_fd, pkt)
        else:
            self._seq += 1
            heapq.heappush(self._heap, (at_s, self._seq, out_fd, pkt))

    def flush(self) -> None:
        """Write every packet that is due now."""
        heap = self._heap
        now = self.clock()
        while heap and heap[0][0] <= now:
            at_s, _, out_fd, pkt = heapq.heappop(heap)
            self.lag_s_total += now - at_s
            self.released += 1
            self._write(out_fd, pkt)

    def _write(self, fd: int, pkt: bytes) -> None:
        try:
            os.write(fd, pkt)
        except OSError:  # receiving device down or its queue full: the packet is lost, as on a wire
            self.write_errors += 1

    def timing(self) -> dict[str, float | int]:
        """How late delayed packets left the relay, on average (scheduling noise added to the RTT)."""
        lag_ms = 1000.0 * self.lag_s_total / self.released if self.released else 0.0
        return {"release_lag_ms_mean": round(lag_ms, 4), "write_errors": self.write_errors}

    def drop_in_flight(self, direction: str = "both") -> int:
        """Lose the packets still on the line in ``direction`` (a cut fibre loses what it carries)."""
        dropped_fds = {out for d, out in self._route.values() if direction in ("both", d)}
        kept = [item for item in self._heap if item[2] not in dropped_fds]
        n = len(self._heap) - len(kept)
        heapq.heapify(kept)
        self._heap = kept
        return n
