"""A request the router ends while P's engine is prefilling it is released on P all the same.

The router ends a run at its deadline (or on a failure, or when the client goes away) and cancels
its legs; P's Prefill call is then cancelled while the engine runs the prefill, which the engine
finishes whoever waits. P released the request only after a prefill it had waited for, so such a
request stayed live in P's engine for good: its KV blocks taken in P's pool, and a later request
with the same id failed at P (``request ... is already live``). Real processes on loopback: the
router, P, RLD and MD, each request through the router's gRPC API.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from harness.cluster import Cluster, ClusterSpec, NoWan
from pddlink.serving.http import fetch
from pddlink.serving.rpc import stubs

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

PROMPT_TOKENS = 3000  # a prefill of ~0.5 s on the tiny float64 model: the deadline falls inside it


@pytest.fixture(scope="module", params=["thread", "process"])
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Both engine modes: in the sidecar's thread, and a child process over the engine link (the
    chaos suite's deployment)."""
    spec = ClusterSpec(tmp_path_factory.mktemp("cancel"), relay=True, tls=True, engine_mode=request.param)
    with Cluster(NoWan(), spec) as c:  # type: ignore[arg-type]
        yield c


def generate(cluster: Cluster, rid: str, prompt: list[int], deadline_s: float) -> dict[str, Any]:
    """One streamed request; its closing event (outcome, reason)."""
    pb2, pb2_grpc = stubs()

    async def main() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(cluster.router_target) as channel:
            msg = pb2.GenerateRequest(
                request_id=rid,
                prompt=prompt,
                sampling=pb2.Sampling(seed=1, temperature=0.0, max_tokens=4),
                deadline_s=deadline_s,
                pipeline="p_md",
            )
            async for ev in pb2_grpc.RouterStub(channel).Generate(msg, timeout=deadline_s + 10):
                if ev.done:
                    return {"outcome": ev.outcome, "reason": ev.reason}
        return {"outcome": "", "reason": "no closing event"}

    return asyncio.run(main())


def p_transfers(cluster: Cluster) -> dict[str, Any]:
    code, body = fetch("unix:" + cluster.admin_socket("p"), "GET", "/status", timeout_s=5.0)
    assert code == 200
    doc: dict[str, Any] = json.loads(body)["transfers"]
    return doc


def test_a_request_ended_mid_prefill_is_released_on_p(cluster: Cluster) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1, 2048) for _ in range(PROMPT_TOKENS)]
    assert generate(cluster, "warm", prompt[::-1], 30.0)["outcome"] == "finished"  # engines warm
    first = generate(cluster, "cut", prompt, 0.15)
    assert (first["outcome"], first["reason"]) == ("failed", "deadline_exceeded"), first
    until = time.monotonic() + 5.0  # the prefill still running on P's engine ends, then its release
    while (held := p_transfers(cluster)).get("in_engine") != 0 and time.monotonic() < until:
        time.sleep(0.1)
    again = generate(cluster, "cut", prompt, 30.0)  # the same id: P must not hold it any more
    assert again["outcome"] == "finished", again
    assert held.get("in_engine") == 0 and held["in_flight"] == 0, held
