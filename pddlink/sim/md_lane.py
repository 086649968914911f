"""MainDecode's own prefill lane: what recompute costs on the decode side.

MD prefills a missing suffix on the chips that decode (chunked prefill: a slice of each iteration).
Decoding comes first: the lane gets the share of the instance that keeps its step time within the
TPOT bound (``share = 1 - step / tpot_bound``, at least ``min_share`` so queued work still moves,
at most ``max_share``), and while it runs every iteration takes ``1 / (1 - share)`` as long. So
recompute is cheap on an MD with TPOT headroom and slow on a saturated one, and the policy sees it
in ``backlog_s``. Prefill speed is MD's hardware model (a decode-leaning chip prefills slower).
FIFO, one prompt at a time; the share is fixed when a prompt starts.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from pddlink.sim.resources import Callback, Clock, DecodeInstance


class MdPrefillLane:
    def __init__(
        self,
        clock: Clock,
        decode: DecodeInstance,
        tpot_bound_s: float,
        *,
        min_share: float = 0.05,
        max_share: float = 0.5,
    ) -> None:
        self.clock, self.decode, self.tpot_bound_s = clock, decode, tpot_bound_s
        self.min_share, self.max_share = min_share, max_share
        self.model = decode.model
        self._queue: deque[tuple[float, Callback, Any]] = deque()  # (work_s at full speed, fn, arg)
        self.queued_work_s = 0.0
        self._busy_until = 0.0
        self.busy_s = 0.0

    def share(self) -> float:
        headroom = 1.0 - self.decode.base_step_s() / self.tpot_bound_s
        return min(self.max_share, max(self.min_share, headroom))

    def work_s(self, new_tokens: int, cached_tokens: int) -> float:
        return self.model.fig.prefill_batch_s + self.model.prefill_s(new_tokens, cached_tokens)

    def backlog_s(self, now: float) -> float:
        """Time until a prompt submitted now would start: what runs plus what waits, at the share
        the instance gives the lane now."""
        busy = max(0.0, self._busy_until - now)
        return busy + max(0.0, self.queued_work_s) / self.share()

    def submit(self, new_tokens: int, cached_tokens: int, now: float, done: Callback, arg: Any) -> None:
        work = self.work_s(new_tokens, cached_tokens)
        self._queue.append((work, done, arg))
        self.queued_work_s += work
        if self._busy_until <= now:
            self._start(now)

    def _start(self, now: float) -> None:
        work, done, arg = self._queue.popleft()
        self.queued_work_s -= work
        share = self.share()
        took = work / share
        self._busy_until = now + took
        self.busy_s += took
        self.decode.slow_down(now, 1.0 / (1.0 - share))
        self.clock.at(self._busy_until, self._finish, (done, arg))

    def _finish(self, now: float, item: tuple[Callback, Any]) -> None:
        if self._queue:
            self._start(now)
        else:
            self.decode.slow_down(now, 1.0)
        done, arg = item
        done(now, arg)
