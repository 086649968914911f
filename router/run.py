"""One request at the router: the asyncio driver of ``pddlink.lifecycle.RequestRun``.

The machine decides (legs, merge, fallbacks, deadline); this driver feeds it: it runs each command
through the run's ``router.leg_driver.LegDriver`` (over the engine's calls: gRPC ``router.legs`` or
HTTP ``router.vllm_legs``), hands every event from the inbox to the machine,
re-arms the machine's timer, and yields the merged tokens. If the client goes away (the generator
is closed) the machine is told so, and the legs are torn down either way: in the background, so
the run's end (and the client's closing event) never waits for a sidecar to answer ``Release``
(one behind a cut WAN answers late or never; each teardown is bounded by its calls' own timeouts).
Metrics are counted here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

from pddlink import metrics
from pddlink.handoff import MergedToken
from pddlink.lifecycle import (
    Emit,
    FallbackTaken,
    MdStalled,
    MdSuspected,
    MoveOff,
    RequestRun,
    RunCommand,
    RunSpec,
    RunState,
    RunTrace,
)
from pddlink.roles import Role
from router.leg_driver import Cluster, LegDriver

__all__ = ["Cluster", "RunDriver", "teardowns_pending"]

_TEARDOWNS: set[asyncio.Task[None]] = set()  # legs being torn down after their run ended


def teardowns_pending() -> int:
    """Runs whose legs are still being torn down (each ends within its calls' timeouts)."""
    return sum(not t.done() for t in _TEARDOWNS)


class RunDriver:
    def __init__(
        self,
        legs: Callable[[float], LegDriver],
        spec: RunSpec,
        rld_usable: Callable[[float], bool],
        *,
        arrived: float | None = None,
        on_md_stalled: Callable[[float], None] | None = None,
        rld_reachable: Callable[[float], bool] | None = None,
        spare: Callable[[Role, float], bool] | None = None,
        on_move: Callable[[Role], None] | None = None,
    ) -> None:
        """``legs``: the engine backend's legs for a deadline; ``arrived``: when the request reached
        the router (its deadline counts from then); ``on_md_stalled``: told when MD stalled;
        ``spare`` / ``on_move``: the router's pools (another instance of a role in placement; move
        this run there, before the next leg's calls)."""
        self.spec = spec
        self.on_md_stalled = on_md_stalled
        self.on_move = on_move
        now = time.monotonic()
        self.machine = RequestRun(
            spec,
            now=now if arrived is None else min(arrived, now),
            rld_usable=rld_usable,
            rld_reachable=rld_reachable,
            spare=spare if on_move is not None else None,
        )
        self.calls = legs(self.machine.deadline)

    @property
    def trace(self) -> RunTrace:
        assert self.machine.trace is not None, "the run has not ended"
        return self.machine.trace

    def suspect_md(self) -> None:
        """Another run saw MD stall: this run's machine hears it next (``MdSuspected``)."""
        self.calls.inbox.put_nowait(MdSuspected())

    async def run(self) -> AsyncGenerator[MergedToken, None]:
        m = self.machine
        metrics.REQUESTS_IN_FLIGHT.labels(pipeline=self.spec.pipeline.value).inc()
        try:
            for tok in self._apply(m.start(time.monotonic())):
                yield tok
            while m.state is not RunState.ENDED:
                for tok in self._apply(await self._next()):
                    yield tok
        finally:
            if m.state is not RunState.ENDED:  # the client went away
                self._apply(m.cancel(time.monotonic()))
            task = asyncio.get_running_loop().create_task(self.calls.close(finished=m.merger.finished))
            _TEARDOWNS.add(task)
            task.add_done_callback(_TEARDOWNS.discard)
            self._count(self.trace)

    async def _next(self) -> list[RunCommand]:
        """Wait for the next event or the machine's timer, whichever comes first, and feed it."""
        m = self.machine
        timer = m.get_timer()
        assert timer is not None
        left = timer - time.monotonic()
        if left <= 0:
            return m.handle_timer(time.monotonic())
        try:
            event = await asyncio.wait_for(self.calls.inbox.get(), timeout=left)
        except TimeoutError:
            return m.handle_timer(max(time.monotonic(), timer))
        return m.handle(event, time.monotonic())

    def _apply(self, commands: list[RunCommand]) -> list[MergedToken]:
        """Run every command now; the tokens to send come back (so a client that stops reading
        mid-batch cannot leave a command unrun)."""
        tokens = []
        for cmd in commands:
            if isinstance(cmd, Emit):
                tokens.append(cmd.token)
            elif isinstance(cmd, FallbackTaken):
                metrics.FALLBACKS.labels(kind=cmd.fallback.value).inc()
            elif isinstance(cmd, MoveOff):
                if self.on_move is not None:
                    self.on_move(cmd.role)
            elif isinstance(cmd, MdStalled):
                if self.on_md_stalled is not None:
                    self.on_md_stalled(cmd.seconds)
            else:
                self.calls.execute(cmd)
        return tokens

    def _count(self, t: RunTrace) -> None:
        pipeline = self.spec.pipeline.value
        metrics.REQUESTS_IN_FLIGHT.labels(pipeline=pipeline).dec()
        metrics.REQUESTS.labels(pipeline=pipeline, outcome=t.outcome.value).inc()
        if t.ttft_s is not None:
            metrics.TTFT_SECONDS.labels(pipeline=pipeline).observe(t.ttft_s)
        for src, n in t.tokens:
            metrics.TOKENS.labels(source=src).inc(n)
