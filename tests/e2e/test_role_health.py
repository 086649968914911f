"""The router notices a lost role at once and reconnects to a restarted one before it sends it
traffic (issue 16, item 5 and the chaos runs: after kill -9 and restart of P, gRPC's reconnect
backoff kept the router's channel failing with ``failed to connect to all addresses``; a lost
RelayDecode was noticed only after the next request ended).

Real processes over loopback with mutual TLS (``harness.cluster``); kill -9 and restart are real.
No request runs while RLD is down: the router's ``/status`` must still show it unusable within
about a second, and usable again only once the restarted RLD answers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engines_adapter import SamplingParams
from harness.cluster import Cluster, ClusterSpec, NoWan
from harness.demo_load import replay
from harness.demo_workload import DemoRequest
from pddlink.serving.http import fetch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(Path(tmp_path_factory.mktemp("health")), relay=True, slice_tokens=4)
    with Cluster(NoWan(), spec) as c:  # type: ignore[arg-type]
        yield c


def roles(cluster: Cluster) -> dict[str, Any]:
    code, body = fetch("unix:" + cluster.router_unix, "GET", "/status", timeout_s=5.0)
    assert code == 200, body
    doc: dict[str, Any] = json.loads(body)["roles"]
    return doc


def within(pred: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``pred`` held, None if it never did within ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if pred():
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def one(cluster: Cluster, index: int, pipeline: str) -> Any:
    req = DemoRequest(index, 0.0, tuple(range(5, 40)), SamplingParams(max_tokens=12, temperature=0.0))
    (res,) = asyncio.run(replay(cluster.router_target, [req], deadline_s=20.0, pipeline=pipeline))
    return res


def test_a_lost_rld_leaves_the_pool_at_once_and_returns_only_when_it_answers(cluster: Cluster) -> None:
    assert within(lambda: all(r["usable"] for r in roles(cluster).values()), 10.0) is not None
    cluster.kill("rld")
    noticed = within(lambda: not roles(cluster)["rld"]["usable"], 5.0)
    assert noticed is not None and noticed < 3.0, roles(cluster)
    assert roles(cluster)["p"]["usable"] and roles(cluster)["md"]["usable"]
    res = one(cluster, 1, "")  # RLD is down: the router's own choice avoids it
    assert res.outcome == "finished", res.reason
    assert res.trace["pipeline"] == "p_md" and not res.trace["fallbacks"], res.trace
    cluster.restart("rld")  # returns once the restarted RLD printed READY
    back = within(lambda: roles(cluster)["rld"]["usable"], 10.0)
    assert back is not None and back < 5.0, roles(cluster)
    res = one(cluster, 2, "p_rld_md")
    assert res.outcome == "finished", (res.reason, res.trace)
    assert roles(cluster)["rld"]["losses"] >= 1


def test_a_restarted_p_is_reconnected_within_two_seconds(cluster: Cluster) -> None:
    cluster.kill("p")
    assert within(lambda: not roles(cluster)["p"]["usable"], 5.0) is not None
    time.sleep(8.0)  # down long enough that gRPC's default backoff would have grown past 5 s
    cluster.restart("p")
    back = within(lambda: roles(cluster)["p"]["usable"], 10.0)
    assert back is not None and back < 2.0, roles(cluster)  # gRPC defaults: 3 s and more
    results = [one(cluster, 10 + i, "p_md") for i in range(3)]
    assert [r.outcome for r in results] == ["finished"] * 3, [r.reason for r in results]


def test_a_request_sent_while_p_is_down_goes_out_once_p_is_back(cluster: Cluster) -> None:
    """P has no stand-in: a request that arrives during P's restart waits (within its deadline)
    for the channel to be READY instead of failing with ``failed to connect to all addresses``."""
    cluster.kill("p")
    assert within(lambda: not roles(cluster)["p"]["usable"], 5.0) is not None
    out: list[Any] = []
    sender = threading.Thread(target=lambda: out.append(one(cluster, 20, "p_md")))
    sender.start()
    time.sleep(1.0)  # the request is in the router, P is still down
    cluster.restart("p")
    sender.join(30.0)
    (res,) = out
    assert res.outcome == "finished", res.reason
