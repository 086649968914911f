"""A request moves to another MD when its MD dies mid-stream (issue 26), as processes with mutual
TLS per instance: two P and one RLD in dc-a, one MD in dc-b and one in dc-c. Long P->MD requests
stream; the MD most of them run on is killed with -9; every one of them finishes with the tokens
one engine generates alone, and those that were on the killed MD moved to the other one
(``placement.moved`` names the move; a move for another reason, e.g. a first shipment that failed
while the WAN pools came up, may go anywhere but never back to an MD the run lost)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from engines_adapter import SamplingParams
from harness.demo_load import replay
from harness.demo_workload import DemoRequest
from harness.pool_cluster import PoolCluster, PoolSpec
from pddlink.topology import parse_topology
from tests.e2e.test_e2e_pipeline import reference
from tests.e2e.test_router_pools import TOPOLOGY, _instances

# fleet: 41 s and 53 s here; CI's processes phase (make test's long pole) has no room for them
pytestmark = [pytest.mark.e2e, pytest.mark.fleet, pytest.mark.timeout(300)]

MAX_TOKENS = 600  # about a second of decoding each on the tiny engine


def _req(i: int) -> DemoRequest:
    prompt = tuple((11 * i + 7 * j) % 2000 + 1 for j in range(48))
    return DemoRequest(
        i, 0.0, prompt, SamplingParams(seed=90 + i, temperature=0.8, top_k=40, max_tokens=MAX_TOKENS)
    )


def test_requests_whose_md_dies_mid_stream_finish_on_the_other_md_exactly(tmp_path: Path) -> None:
    spec = PoolSpec(tmp_path, parse_topology(TOPOLOGY), placement="least_loaded", relay=False, tls=True)
    reqs = [_req(i) for i in range(6)]
    with PoolCluster(spec) as pools:
        warm = [
            DemoRequest(90 + i, 0.0, r.prompt[:20], SamplingParams(max_tokens=2))
            for i, r in enumerate(reqs[:4])
        ]
        asyncio.run(replay(pools.router_target, warm, deadline_s=30.0, id_prefix="w"))  # P's WAN pools up
        killed: list[str] = []

        def kill_when_streaming() -> None:
            until = time.monotonic() + 30.0
            while time.monotonic() < until:
                running = {n: i["running"] for n, i in _instances(pools).items() if n.startswith("md")}
                if sum(running.values()) >= len(reqs):
                    time.sleep(0.2)  # tokens flow on both MDs
                    victim = max(running, key=lambda n: running[n])
                    pools.kill(victim)
                    killed.append(victim)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_when_streaming)
        killer.start()
        results = asyncio.run(
            replay(pools.router_target, reqs, deadline_s=60.0, pipeline="p_md", id_prefix="m")
        )
        killer.join()
    assert killed, "the requests never ran on the MDs at once"
    dead = killed[0]
    assert [r.outcome for r in results] == ["finished"] * len(reqs), [r.reason for r in results]
    moved = [r for r in results if r.trace["placement"]["moved"]]
    assert moved, "no request was on the killed MD when it died"
    for r in moved:
        assert r.trace["placement"]["moved"] == [
            {"role": "md", "from": dead, "to": r.trace["placement"]["md"]}
        ]
        assert r.trace["placement"]["md"] != dead and "md_lost_other_md" in r.trace["fallbacks"]
    assert [r.tokens for r in results] == reference(reqs)


def test_an_md_killed_behind_its_wan_relay_is_placed_on_again_within_10_s_of_its_restart(
    tmp_path: Path,
) -> None:
    """The MDs reached through netlab loopback relays (one per WAN link), as ``pddlink chaos
    --topology`` runs them: after kill -9 and a restart on its ports, the router's channel through
    the relay reconnects, the MD is back in placement and gets requests again (exact tokens)."""
    from harness.demo_pools import LoopbackWan

    topology = parse_topology(TOPOLOGY)
    wan = LoopbackWan(topology, f"tpm{tmp_path.stat().st_ino % 10000}")
    try:
        spec = PoolSpec(tmp_path, topology, placement="least_loaded", relay=False, tls=True)
        with PoolCluster(spec, wan=wan) as pools:
            first = asyncio.run(
                replay(pools.router_target, [_req(i) for i in range(4)], deadline_s=30.0, id_prefix="a")
            )
            assert [r.outcome for r in first] == ["finished"] * 4
            pools.kill("md-b0")
            time.sleep(2.0)
            pools.start_again("md-b0")
            up = time.monotonic()
            placed: list[str] = []
            sent: list[DemoRequest] = []
            got: list[list[int]] = []
            k = 10
            while time.monotonic() < up + 10.0 and "md-b0" not in placed:
                batch = [_req(i) for i in range(k, k + 2)]
                done = asyncio.run(replay(pools.router_target, batch, deadline_s=30.0, id_prefix=f"b{k}"))
                assert [r.outcome for r in done] == ["finished"] * 2, [r.reason for r in done]
                sent += batch
                got += [r.tokens for r in done]
                placed += [r.trace["placement"]["md"] for r in done]
                k += 2
            assert "md-b0" in placed, f"md-b0 not placed on within 10 s of its restart: {placed}"
            assert _instances(pools)["md-b0"]["in_placement"]
        assert got == reference(sent)
    finally:
        wan.down()
