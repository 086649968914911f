"""Simulated resources: the event clock, prefill and decode instances (the WAN line: ``sim.wan``).

All are fluid models driven by one ``Clock`` (a heap of timed callbacks), so an hour of traffic costs
a few events per request, not one per token or packet:

- ``PrefillInstance``: FIFO queue; an idle instance takes a batch of queued prompts up to a token
  budget and runs them as one batch (one fixed cost, the sum of their compute). MainDecode's own
  prefill lane (recompute) is one too, whose batches ``stall`` its decode instance.
- ``DecodeInstance``: continuous batching. One iteration emits one token for every running sequence
  and lasts ``step_s(n, context)``; a virtual "iterations done" clock gives each sequence's finish.
  Admission waits FIFO while the batch or the KV pool is full.

A change of state bumps a resource's version; a timer armed before the change is ignored when it fires.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from pddlink.sim.hardware import InstanceModel

Callback = Callable[[float, Any], None]


class Clock:
    """Discrete-event loop: callbacks ``fn(now, arg)`` in time order (FIFO among equal times)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callback, Any]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callback, arg: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def run(self, until: float = float("inf")) -> None:
        heap, pop = self._heap, heapq.heappop
        events = 0
        while heap and heap[0][0] <= until:
            t, _, fn, arg = pop(heap)
            self.now = t
            events += 1
            fn(t, arg)
        self.events += events


class PrefillInstance:
    """A P instance: FIFO queue, batched prefill."""

    def __init__(
        self,
        clock: Clock,
        model: InstanceModel,
        name: str,
        on_batch: Callable[[float, float], None] | None = None,
    ) -> None:
        self.clock, self.model, self.name = clock, model, name
        self.on_batch = on_batch  # (now, compute_s): a decode instance that prefills stalls that long
        self._queue: deque[tuple[int, float, Callback, Any]] = deque()  # (new_tokens, compute_s, fn, arg)
        self.queued_s = 0.0
        self._busy_until = 0.0
        self.busy_s = 0.0

    def backlog_s(self, now: float) -> float:
        busy = self._busy_until - now
        return self.queued_s + busy if busy > 0.0 else self.queued_s

    def submit(self, new_tokens: int, cached_tokens: int, now: float, done: Callback, arg: Any) -> None:
        compute = self.model.prefill_s(new_tokens, cached_tokens)
        self._queue.append((new_tokens, compute, done, arg))
        self.queued_s += compute
        if self._busy_until <= now:
            self._start_batch(now)

    def _start_batch(self, now: float) -> None:
        budget = self.model.fig.prefill_batch_tokens
        batch: list[tuple[int, float, Callback, Any]] = []
        tokens, compute = 0, self.model.fig.prefill_batch_s
        while self._queue and (not batch or tokens + self._queue[0][0] <= budget):
            item = self._queue.popleft()
            batch.append(item)
            tokens += item[0]
            compute += item[1]
            self.queued_s -= item[1]
        self._busy_until = now + compute
        self.busy_s += compute
        if self.on_batch is not None:
            self.on_batch(now, compute)
        self.clock.at(self._busy_until, self._on_batch_done, batch)

    def _on_batch_done(self, now: float, batch: list[tuple[int, float, Callback, Any]]) -> None:
        if self._queue:
            self._start_batch(now)
        for _, _, done, arg in batch:
            done(now, arg)


class DecodeSeq:
    """One sequence running (or waiting) on a decode instance."""

    __slots__ = ("arg", "context", "done", "first_token", "gone", "start_v", "tokens")

    def __init__(self, tokens: int, context: int, done: Callback, arg: Any, first_token: Callback) -> None:
        self.tokens, self.context, self.done, self.arg = tokens, context, done, arg
        self.first_token = first_token
        self.start_v = 0.0
        self.gone = False


class DecodeInstance:
    """A decode instance (D, RLD or MD) with continuous batching."""

    def __init__(self, clock: Clock, model: InstanceModel, name: str) -> None:
        self.clock, self.model, self.name = clock, model, name
        self.max_seqs, self._kv_capacity = model.max_seqs, model.kv_capacity_tokens
        self._slow = 1.0  # > 1 while the instance's chips also prefill (``slow_down``)
        self._chunk_s = 0.0  # > 0 while each iteration also carries a prefill chunk (``chunk_steps``)
        self._model_step_s = model.step_s
        self._v = 0.0  # iterations done
        self._t = 0.0
        self._running: list[tuple[float, int, DecodeSeq]] = []  # heap of (finish_v, id, seq)
        self._n = 0
        self._context = 0
        self._kv_used = 0
        self._waiting: deque[DecodeSeq] = deque()
        self._ids = 0
        self._version = 0
        self.tokens_emitted = 0.0

    @property
    def load(self) -> int:
        return self._n + len(self._waiting)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def tpot_s(self) -> float:
        return self._step_s(self._n or 1, self._context)

    @property
    def running(self) -> int:
        """Sequences in the batch (decoding now)."""
        return self._n

    def running_args(self) -> list[Any]:
        """The ``arg`` of each sequence in the batch."""
        return [seq.arg for _, _, seq in self._running if not seq.gone]

    def running_progress(self, now: float) -> list[tuple[Any, int]]:
        """The ``arg`` of each sequence in the batch and the tokens it has produced by ``now``
        (read without advancing the instance)."""
        v = self._v
        if now > self._t and self._n:
            v += (now - self._t) / self._step_s(self._n, self._context)
        return [(seq.arg, int(v - seq.start_v)) for _, _, seq in self._running if not seq.gone]

    @property
    def kv_use_fraction(self) -> float:
        return self._kv_used / self._kv_capacity

    def stall(self, now: float, seconds: float) -> None:
        """The instance's chips do other work (MainDecode recomputing a prompt) for ``seconds``:
        no decode iteration advances meanwhile; every sequence's next tokens move that much later."""
        self._advance(now)
        self._t = max(self._t, now) + seconds
        self._arm()

    def _step_s(self, seqs: int, context_tokens: int) -> float:
        return self._model_step_s(seqs, context_tokens) * self._slow + self._chunk_s

    def chunk_steps(self, now: float, chunk_s: float) -> None:
        """From ``now`` on every iteration also carries a prefill chunk of ``chunk_s`` (chunked
        prefill with a fixed token budget: MainDecode recomputing a prompt); 0 ends it."""
        self._advance(now)
        self._chunk_s = chunk_s
        self._arm()

    def slow_down(self, now: float, factor: float) -> None:
        """From ``now`` on every iteration takes ``factor`` times its time (the chips also run a
        prefill: MainDecode recomputing prompts); 1 restores full speed."""
        self._advance(now)
        self._slow = factor
        self._arm()

    def base_step_s(self) -> float:
        """The step time without any prefill sharing the chips."""
        return self.model.step_s(self._n or 1, self._context)

    def _advance(self, now: float) -> None:
        if now <= self._t:  # inside a stall (or no time passed)
            return
        dt = now - self._t
        if dt > 0 and self._n:
            dv = dt / self._step_s(self._n, self._context)
            self._v += dv
            self.tokens_emitted += dv * self._n
        self._t = now

    def admit(self, seq: DecodeSeq, now: float) -> None:
        """Start decoding ``seq.tokens`` tokens as soon as the batch and the KV pool have room."""
        self._advance(now)
        self._waiting.append(seq)
        self._fill(now)
        self._arm()

    def _fits(self, seq: DecodeSeq) -> bool:
        n = self._n
        return n < self.max_seqs and (n == 0 or self._kv_used + seq.context <= self._kv_capacity)

    def _fill(self, now: float) -> None:
        waiting = self._waiting
        while waiting and self._fits(waiting[0]):
            seq = waiting.popleft()
            seq.start_v = self._v
            self._ids += 1
            heapq.heappush(self._running, (self._v + seq.tokens, self._ids, seq))
            self._n += 1
            self._context += seq.context
            self._kv_used += seq.context
            seq.first_token(max(now, self._t) + self._step_s(self._n, self._context), seq.arg)

    def generated(self, seq: DecodeSeq, now: float) -> int:
        self._advance(now)
        return min(seq.tokens, int(self._v - seq.start_v))

    def remove(self, seq: DecodeSeq, now: float) -> int:
        """Stop ``seq`` early (handoff); returns the tokens it produced here."""
        self._advance(now)
        produced = min(seq.tokens, int(self._v - seq.start_v))
        seq.gone = True
        self._release(seq)
        self._fill(now)
        self._arm()
        return produced

    def _release(self, seq: DecodeSeq) -> None:
        self._n -= 1
        self._context -= seq.context
        self._kv_used -= seq.context

    def _arm(self) -> None:
        self._version += 1
        while self._running and self._running[0][2].gone:
            heapq.heappop(self._running)
        if self._running:
            dv = max(0.0, self._running[0][0] - self._v)
            t = self._t + dv * self._step_s(self._n, self._context)
            self.clock.at(t, self._on_timer, self._version)

    def _on_timer(self, now: float, version: int) -> None:
        if version != self._version:
            return
        self._advance(now)
        done = []
        while self._running and (self._running[0][2].gone or self._running[0][0] <= self._v + 1e-6):
            _, _, seq = heapq.heappop(self._running)
            if not seq.gone:
                seq.gone = True
                self._release(seq)
                done.append(seq)
        self._fill(now)
        self._arm()
        for seq in done:
            seq.done(now, seq.arg)
