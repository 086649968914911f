"""An MD whose engine stops producing tokens without closing anything is noticed (issue 16, item 4:
"nothing notices that MD's stream has stalled"): the request moves to RelayDecode and finishes
before its deadline, and the requests the router places keep off MD until it streams again.

Real processes over loopback with mutual TLS (``harness.cluster``, engines as child processes); the
fault is real: SIGSTOP of MD's engine process mid-stream (its sidecar, its sockets and its gRPC
stream stay open; only the tokens stop), SIGCONT at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness.cluster import Cluster, ClusterSpec, NoWan
from pddlink.lifecycle.stall import MD_STALL_MIN_S
from pddlink.serving.http import fetch
from pddlink.serving.rpc import stubs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DEADLINE_S = 30.0
PROMPT = list(range(5, 60))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(Path(tmp_path_factory.mktemp("stall")), relay=True, engine_mode="process")
    with Cluster(NoWan(), spec) as c:
        yield c


@dataclass
class Seen:
    sources: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    outcome: str = ""
    reason: str = ""
    trace: dict[str, Any] = field(default_factory=dict)
    e2e_s: float = 0.0
    stopped_at: float | None = None  # seconds into the request when MD's engine was stopped
    ended_at: float = 0.0


async def generate(cluster: Cluster, pipeline: str, max_tokens: int, stop_after_md: int = 0) -> Seen:
    """One streaming request; with ``stop_after_md`` MD's engine is SIGSTOPped once MD streamed that many."""
    pb2, pb2_grpc = stubs()
    seen = Seen()
    msg = pb2.GenerateRequest(
        prompt=PROMPT,
        sampling=pb2.Sampling(temperature=0.0, max_tokens=max_tokens),
        deadline_s=DEADLINE_S,
        pipeline=pipeline,
    )
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(cluster.router_target) as ch:
        async for ev in pb2_grpc.RouterStub(ch).Generate(msg, timeout=DEADLINE_S + 10):
            if ev.done:
                seen.outcome, seen.reason = ev.outcome, ev.reason
                seen.trace = json.loads(ev.trace_json or "{}")
                break
            seen.sources.append(ev.source)
            seen.positions.append(ev.position)
            if stop_after_md and seen.stopped_at is None and seen.sources.count("md") >= stop_after_md:
                os.kill(md_engine(cluster), signal.SIGSTOP)
                seen.stopped_at = time.monotonic() - t0
    seen.ended_at = seen.e2e_s = time.monotonic() - t0
    return seen


def md_engine(cluster: Cluster) -> int:
    engines = cluster.pids("md")[1:]
    assert engines, "MD's engine runs as a child process"
    return engines[0]


def router_md(cluster: Cluster) -> dict[str, Any]:
    code, body = fetch("unix:" + cluster.router_unix, "GET", "/status", timeout_s=5.0)
    assert code == 200, body
    doc: dict[str, Any] = json.loads(body)["md"]
    return doc


def test_a_stopped_md_engine_is_noticed_and_the_request_finishes_on_rld(cluster: Cluster) -> None:
    warm = asyncio.run(generate(cluster, "p_md", 8))
    assert warm.outcome == "finished" and set(warm.sources) == {"md"}, (warm.reason, warm.trace)

    async def during_the_stall() -> tuple[Seen, Seen]:
        hit = asyncio.ensure_future(generate(cluster, "p_md", 400, stop_after_md=4))
        while not hit.done() and router_md(cluster)["stalls"] < 1:
            await asyncio.sleep(0.05)
        placed = await generate(cluster, "", 16)  # the router places it while MD is stalled
        return await hit, placed

    try:
        hit, placed = asyncio.run(during_the_stall())
        assert hit.stopped_at is not None, "MD finished before the stop: make the request longer"
        assert hit.outcome == "finished", (hit.reason, hit.trace)
        assert "md_stalled_p_rld" in hit.trace["fallbacks"], hit.trace
        assert hit.sources.count("rld") > 0 and hit.positions == sorted(set(hit.positions))
        assert hit.positions == list(range(len(PROMPT), len(PROMPT) + 400))  # no gap, no duplicate
        assert hit.e2e_s < DEADLINE_S
        assert hit.e2e_s - hit.stopped_at < MD_STALL_MIN_S + 10.0  # noticed, not timed out
        # while MD is stalled, the requests the router places go to RLD alone and finish
        assert placed.outcome == "finished", (placed.reason, placed.trace)
        assert set(placed.sources) == {"rld"}, placed.trace
        assert placed.trace["decision_reason"] == "md_unavailable", placed.trace
        assert placed.trace["fallbacks"] == [] and placed.e2e_s < MD_STALL_MIN_S
        assert not router_md(cluster)["usable"] or hit.e2e_s - hit.stopped_at > MD_STALL_MIN_S + 2
    finally:
        os.kill(md_engine(cluster), signal.SIGCONT)
    # MD streams again: a forced request finishes on MD and resets the router's breaker
    back = asyncio.run(generate(cluster, "p_md", 8))
    assert back.outcome == "finished" and set(back.sources) == {"md"}, (back.reason, back.trace)
    assert router_md(cluster)["usable"]
