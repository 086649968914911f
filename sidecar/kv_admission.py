"""A decoder's admission by KV blocks: refuse at Attach, at once and typed, what its pool cannot hold.

At 50 concurrent streams RelayDecode's pool ran out mid-request (``KV pool has N blocks to give``)
and requests failed late, near their deadlines (issue 16, chaos). Each Attach now books the most
blocks its request can need (prompt plus ``max_tokens``, rounded up to whole blocks); one that does
not fit in what the requests already admitted leave of ``num_blocks`` is refused before anything
starts with ``CapacityRefused`` (``ErrorCode.CAPACITY``; gRPC ``RESOURCE_EXHAUSTED`` with details
starting ``capacity:``). The router then falls back (MD takes over a relay leg; a refused decoder
of its own choice is avoided while it refuses). The booking ends with the Attach stream.

The count of requests is capped too (``max_requests``, 0: no cap beyond the blocks). The booking is
worst-case, exact for RelayDecode (P ships it every block of the prompt, nothing is shared), so the
sidecar books on RLD only: MD reuses cached prefixes across requests (the DRC), and a worst-case
booking there would refuse requests its pool holds well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pddlink.errors import ErrorCode, LocalError


class CapacityRefused(LocalError):
    """No room for this request on this decoder now; nothing was started."""

    code = ErrorCode.CAPACITY


@dataclass(frozen=True, slots=True)
class Booking:
    request_id: str
    blocks: int


class KvAdmission:
    """Books worst-case KV blocks per admitted request against ``num_blocks``."""

    def __init__(self, num_blocks: int, block_size: int, *, max_requests: int = 0) -> None:
        if num_blocks < 1 or block_size < 1 or max_requests < 0:
            raise ValueError("num_blocks and block_size >= 1, max_requests >= 0")
        self.num_blocks, self.block_size, self.max_requests = num_blocks, block_size, max_requests
        self.booked: dict[str, Booking] = {}
        self.booked_blocks = 0
        self.refused = 0

    def need(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_size))

    def admit(self, request_id: str, prompt_tokens: int, max_tokens: int) -> Booking:
        blocks = self.need(prompt_tokens + max_tokens)
        if request_id in self.booked:
            raise CapacityRefused(f"capacity: request {request_id!r} is already attached here")
        if self.max_requests and len(self.booked) >= self.max_requests:
            self.refused += 1
            raise CapacityRefused(
                f"capacity: {len(self.booked)} requests in flight, the cap is {self.max_requests}"
            )
        free = self.num_blocks - self.booked_blocks
        if blocks > free:
            self.refused += 1
            raise CapacityRefused(
                f"capacity: the request can need {blocks} KV blocks, {free} of {self.num_blocks} are unbooked"
            )
        booking = self.booked[request_id] = Booking(request_id, blocks)
        self.booked_blocks += blocks
        return booking

    def release(self, booking: Booking) -> None:
        if self.booked.get(booking.request_id) is booking:
            del self.booked[booking.request_id]
            self.booked_blocks -= booking.blocks

    def status(self) -> dict[str, int]:
        return {
            "requests": len(self.booked),
            "booked_blocks": self.booked_blocks,
            "num_blocks": self.num_blocks,
            "refused": self.refused,
        }
