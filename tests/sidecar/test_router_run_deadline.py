"""A router run ends at its deadline even when the sidecars do not answer: the closing event must
not wait for the legs' teardown (a cancelled Attach sends ``Release``, which a sidecar behind a cut
WAN or a busy one answers late or never).

The chaos suite's hung requests (ended past deadline + 1 s, in the 4x burst) were this: the run's
generator awaited its legs' ``Release`` calls (up to 1 s each) before the router could send the
client its closing event. Fake stubs, a real asyncio driver (``router.run.RunDriver``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engines_adapter.base import SamplingParams
from pddlink.lifecycle import RunSpec
from pddlink.routing import Pipeline
from router.legs import grpc_legs
from router.run import RunDriver, teardowns_pending

HANG_S = 30.0


class Silent:
    """A sidecar stub that accepts every call and answers none (a stalled peer)."""

    def __init__(self) -> None:
        self.releases = 0

    def Attach(self, req: Any, timeout: float) -> AsyncIterator[Any]:
        async def events() -> AsyncIterator[Any]:
            await asyncio.sleep(HANG_S)
            yield None  # pragma: no cover

        return events()

    async def Release(self, req: Any) -> None:
        self.releases += 1
        await asyncio.sleep(HANG_S)

    async def Prefill(self, req: Any, timeout: float) -> None:
        await asyncio.sleep(HANG_S)


class Cluster:
    def __init__(self) -> None:
        self.p, self.rld, self.md = Silent(), Silent(), Silent()
        self.md_identity = self.rld_identity = ""  # the sidecars' own configured peers
        self.rld_active = 0

    def on_prefilled(self, request_id: str, new_tokens: int, seconds: float) -> None:
        pass

    def on_md_ready(self, request_id: str, new_tokens: int, seconds: float) -> None:
        pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pipeline", [Pipeline.P_RLD_MD, Pipeline.SINGULAR, Pipeline.P_MD])
def test_run_ends_at_its_deadline_although_release_hangs(pipeline: Pipeline) -> None:
    deadline_s = 0.5

    async def main() -> None:
        cluster = Cluster()
        spec = RunSpec("r", (1, 2, 3), SamplingParams(max_tokens=4), deadline_s, pipeline, "test", 0.1)
        t0 = time.monotonic()
        driver = RunDriver(lambda d: grpc_legs(cluster, cluster, d), spec, lambda now: True)
        async for _ in driver.run():
            pass
        took = time.monotonic() - t0
        assert driver.trace.reason_text == "deadline_exceeded"
        assert took < deadline_s + 0.3, f"the run ended {took - deadline_s:.2f} s past its deadline"
        # the teardown still happens, in the background, and is bounded
        await asyncio.sleep(1.5)
        assert cluster.rld.releases + cluster.md.releases >= 1
        assert teardowns_pending() == 0
        assert cluster.rld_active == 0

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_the_deadline_counts_from_when_the_request_arrived() -> None:
    """Time the request spent in the router's checks and queues before its run began is its own
    (under load that was part of the chaos suite's hung requests)."""

    async def main() -> None:
        spec = RunSpec("r", (1, 2, 3), SamplingParams(max_tokens=4), 0.5, Pipeline.P_MD, "test", 0.1)
        t0 = time.monotonic()
        cluster = Cluster()
        driver = RunDriver(lambda d: grpc_legs(cluster, cluster, d), spec, lambda now: True, arrived=t0 - 0.3)
        async for _ in driver.run():
            pass
        took = time.monotonic() - t0
        assert driver.trace.reason_text == "deadline_exceeded"
        assert 0.15 < took < 0.45, took

    asyncio.run(main())
