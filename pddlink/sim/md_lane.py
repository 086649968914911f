"""MainDecode's own prefill lane: what recompute costs on the decode side.

MD prefills a missing suffix on the chips that decode (chunked prefill: a slice of each iteration).
Decoding comes first: the lane gets the share of the instance that keeps its step time within the
TPOT bound (``share = 1 - step / tpot_bound``, at least ``min_share`` so queued work still moves,
at most ``max_share``), and while it runs every iteration takes ``1 / (1 - share)`` as long. So
recompute is cheap on an MD with TPOT headroom and slow on a saturated one, and the policy sees it
in ``backlog_s``. Prefill speed is MD's hardware model (a decode-leaning chip prefills slower).
FIFO, one prompt at a time; the share is fixed when a prompt starts.

With ``chunk_tokens`` the lane is instead an engine's chunked prefill with a fixed per-step token
budget (vLLM's ``max_num_batched_tokens``, SGLang's ``chunked_prefill_size``), blind to the TPOT
bound: each decode iteration also carries one chunk, ``c = min(chunk, prompt) * work / prompt``
seconds, so decoding takes ``step + c`` per token while the prompt runs, and the prompt takes
``work + ceil(prompt / chunk) * step``. This is what ``pddlink.routing.MdPrefill.chunk_tokens`` models.
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
        chunk_tokens: int | None = None,
    ) -> None:
        self.clock, self.decode, self.tpot_bound_s = clock, decode, tpot_bound_s
        self.min_share, self.max_share = min_share, max_share
        self.chunk_tokens = chunk_tokens
        self._queued_steps = 0  # chunked: decode steps the queued prompts' chunks ride on
        self.model = decode.model
        self._queue: deque[tuple[float, int, Callback, Any]] = deque()  # (work_s, tokens, fn, arg)
        self.queued_work_s = 0.0
        self._busy_until = 0.0
        self.busy_s = 0.0

    def share(self) -> float:
        """The instance's share the headroom lane takes (not used with ``chunk_tokens``)."""
        headroom = 1.0 - self.decode.base_step_s() / self.tpot_bound_s
        return min(self.max_share, max(self.min_share, headroom))

    def steps(self, tokens: int) -> int:
        """Decode steps a chunked prompt of ``tokens`` rides on (0 without chunks)."""
        return -(-tokens // self.chunk_tokens) if self.chunk_tokens is not None else 0

    def work_s(self, new_tokens: int, cached_tokens: int) -> float:
        return self.model.fig.prefill_batch_s + self.model.prefill_s(new_tokens, cached_tokens)

    def backlog_s(self, now: float) -> float:
        """Time until a prompt submitted now would start: what runs plus what waits, at the share
        the instance gives the lane now."""
        busy = max(0.0, self._busy_until - now)
        work = max(0.0, self.queued_work_s)
        if self.chunk_tokens is not None:
            step = self.decode.base_step_s() if self.decode.running else 0.0
            return busy + work + self._queued_steps * step
        return busy + work / self.share()

    def submit(self, new_tokens: int, cached_tokens: int, now: float, done: Callback, arg: Any) -> None:
        work = self.work_s(new_tokens, cached_tokens)
        self._queue.append((work, new_tokens, done, arg))
        self.queued_work_s += work
        self._queued_steps += self.steps(new_tokens)
        if self._busy_until <= now:
            self._start(now)

    def _start(self, now: float) -> None:
        work, tokens, done, arg = self._queue.popleft()
        self.queued_work_s -= work
        self._queued_steps -= self.steps(tokens)
        if self.chunk_tokens is not None:
            chunk_s = min(tokens, self.chunk_tokens) * work / max(1, tokens)
            step = self.decode.base_step_s() if self.decode.running else 0.0
            took = work + self.steps(tokens) * step
            self.decode.chunk_steps(now, chunk_s)
        else:
            share = self.share()
            took = work / share
            self.decode.slow_down(now, 1.0 / (1.0 - share))
        self._busy_until = now + took
        self.busy_s += took
        self.clock.at(self._busy_until, self._finish, (done, arg))

    def _finish(self, now: float, item: tuple[Callback, Any]) -> None:
        if self._queue:
            self._start(now)
        elif self.chunk_tokens is not None:
            self.decode.chunk_steps(now, 0.0)
        else:
            self.decode.slow_down(now, 1.0)
        done, arg = item
        done(now, arg)
