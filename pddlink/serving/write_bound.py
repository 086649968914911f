"""How long one write of an answer may wait for its client to take the bytes (issue 16: a client
that stops reading must not hold its request, its run's resources or its slot).

The router's runs are pulled by the answer's writer: while a write waits (asyncio's transport over
its high-water mark with the kernel's buffers full, or gRPC's HTTP/2 window spent), the run does
not advance, so its deadline timer does not fire either. Two bounds, both needed, cut such an
answer (the connection or stream is closed and the run cancelled through the usual path: the
router's generator is closed, which cancels the run on every role):

- a stall bound per write (``api.write_stall_s``, 5 s by default): a write waits only once the
  client has left the transport's and the kernel's buffers full, which a reading client empties in
  milliseconds; nothing taken for that long means it stopped reading. Without it a non-reader keeps
  its request until the deadline (up to 600 s).
- a bound on the whole answer: the request's deadline plus ``SEND_GRACE_S``. The run ends by its
  deadline (finished or failed) and the grace covers its closing event; a client that reads, but
  so slowly that the answer would still be going out after that, is cut then. Without it a
  trickling reader keeps a request as long as it likes. So every request ends before its deadline
  + 1 s, whatever its client does.

Sans-I/O: ``left(now)`` is the time the next write may take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pddlink.errors import ConfigError

SEND_GRACE_S = 0.5  # after the deadline: the closing event's own write (the bound is + 1 s)
WRITE_STALL_S = 5.0
# A fixed kernel send buffer per connection (the kernel doubles it): autotuning lets one that a
# client does not read grow to tcp_wmem's maximum (4 MiB here), kernel memory pinned per slow
# client and several MB unread before a write waits at all (so before the stall bound sees it).
# 128 KiB per round trip is 13 MB/s at 10 ms, 1.3 MB/s at 100 ms: token streams need tens of kB/s.
SEND_BUFFER_BYTES = 128 << 10


@dataclass(frozen=True, slots=True)
class WriteBound:
    """``stall_s``: the longest one write may wait; ``send_by``: when (monotonic seconds) the whole
    answer must have been taken (``math.inf``: no bound beyond the stall)."""

    stall_s: float = WRITE_STALL_S
    send_by: float = math.inf

    def __post_init__(self) -> None:
        if not self.stall_s > 0:
            raise ConfigError(f"write stall bound must be > 0 s, got {self.stall_s}")

    @classmethod
    def for_request(cls, stall_s: float, started: float, deadline_s: float) -> WriteBound:
        """The bound of a request that began at ``started`` (monotonic) with its deadline."""
        return cls(stall_s, started + deadline_s + SEND_GRACE_S)

    def left(self, now: float) -> float:
        """Seconds the next write may wait (0 once the answer is due: the write is cut at once
        unless its bytes fit the buffers)."""
        return max(0.0, min(self.stall_s, self.send_by - now))

    def reason(self, now: float) -> str:
        """Why a write that ran out of time at ``now`` was cut (logs, gRPC details)."""
        if now >= self.send_by:
            return "the client did not take the answer before its deadline"
        return f"the client took nothing for {self.stall_s:g} s"
