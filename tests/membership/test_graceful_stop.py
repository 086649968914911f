"""SIGTERM (issue 29), real processes, a real etcd, mutual TLS:

- on a router: a stream in flight ends whole (every token, exact), its HTTP port refuses new
  connections at once, and the process exits 0 when the stream is done, not at its bound;
- on a sidecar that announced itself: it leaves placement at once (its lease revoked, not left to
  expire) and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _etcd_server import EtcdServer

from engines_adapter import SamplingParams
from harness.demo_load import replay
from harness.demo_workload import DemoRequest
from harness.pool_cluster import PoolCluster, PoolSpec
from pddlink.roles import Role
from pddlink.topology import parse_topology
from tests.e2e.test_e2e_pipeline import reference
from tests.membership.test_router_membership import TOPOLOGY, _in_placement, _until

pytestmark = [pytest.mark.e2e, pytest.mark.fleet, pytest.mark.timeout(300)]
TTL_S = 10  # far longer than a revoked lease takes to show


def test_sigterm_finishes_streams_and_leaves_at_once(tmp_path: Path, own_etcd: EtcdServer) -> None:
    spec = PoolSpec(
        tmp_path, parse_topology(TOPOLOGY), placement="round_robin", relay=False, etcd=own_etcd.endpoint,
        ttl_s=TTL_S,
    )  # fmt: skip
    with PoolCluster(spec) as pools:
        # a sidecar that announced itself: SIGTERM takes it out of placement at once
        pools.add_sidecar("md-b1", Role.MD, "dc-b")
        _until(lambda: _in_placement(pools).get("md-b1") is True, 5.0)
        t0 = time.monotonic()
        pools.procs["md-b1"].send_signal(signal.SIGTERM)
        _until(lambda: not _in_placement(pools).get("md-b1", False), TTL_S)
        left_s = time.monotonic() - t0
        assert left_s < 2.0, f"md-b1 left placement {left_s:.1f} s after SIGTERM (lease TTL {TTL_S} s)"
        assert pools.procs["md-b1"].wait(10) == 0

        # the router: the stream in flight ends whole, no new connection, exit 0 once it is done
        sampling = SamplingParams(seed=5, temperature=0.8, max_tokens=160)
        long = DemoRequest(0, 0.0, tuple(range(1, 200)), sampling)
        router = pools.procs["router"]

        async def scenario() -> tuple[float, float, list[int], str]:
            task = asyncio.create_task(replay(pools.router_target, [long], deadline_s=30.0, pipeline="p_md"))
            await asyncio.sleep(1.0)
            sent = time.monotonic()
            router.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:
                await asyncio.to_thread(urllib.request.urlopen, pools.router_url() + "/healthz", timeout=2)
                refused = "answered"
            except (urllib.error.URLError, ConnectionError) as exc:
                refused = type(exc).__name__
            (res,) = await task
            return sent, time.monotonic(), res.tokens if res.outcome == "finished" else [], refused

        sent, done, tokens, refused = asyncio.run(scenario())
        assert done - sent > 0.2, "the stream ended before SIGTERM: nothing was in flight"
        assert refused != "answered", "the router's HTTP port took a new connection after SIGTERM"
        assert router.wait(10) == 0
        assert time.monotonic() - done < 8.0  # it went once the stream was done, not at its 30 s bound
        assert tokens == reference([long])[0]
