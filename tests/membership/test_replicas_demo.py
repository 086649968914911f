"""``pddlink demo --topology F --routers 2`` at a small scale (``harness.demo_replicas``): the same
requests through one router, then through two behind a real HAProxy; every request of both runs
finishes with exactly the tokens one engine generates alone, the load balancer spreads them over
both routers, and the JSON has what ``../shared/checks/replicas`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.demo_replicas import main
from harness.lb import LoadBalancerMissing, haproxy_binary
from pddlink.topology import parse_topology

pytestmark = [pytest.mark.e2e, pytest.mark.fleet, pytest.mark.timeout(600)]

TOPOLOGY = """
[topology]
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", address = "127.0.0.1:1" }]
rld = [{ name = "rld-a0", address = "127.0.0.1:2" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", address = "127.0.0.1:3" }, { name = "md-b1", address = "127.0.0.1:4" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 16
rtt_ms = 20
"""


def test_one_router_then_two_behind_haproxy(tmp_path: Path) -> None:
    try:
        haproxy_binary()
    except LoadBalancerMissing as exc:
        pytest.skip(str(exc))
    out = tmp_path / "replicas.json"
    main(topology=parse_topology(TOPOLOGY), topology_path="inline", routers=2, requests=16, rate_rps=4.0,
         workload=None, json_path=str(out), seed=3, warmup=4)  # fmt: skip
    doc = json.loads(out.read_text())
    one, two = doc["runs"]["one"], doc["runs"]["two"]
    for run in (one, two):
        assert (run["requests"], run["failed"], run["token_mismatches"]) == (16, 0, 0), run["failure_reasons"]
        assert run["ttft_s"]["p90"] > 0 and 0 <= run["md_hit_rate"] <= 1
    assert one["served_by_key"] == {"router0": 16}
    assert set(two["served_by_key"]) == {"router0", "router1"} and min(two["served_by_key"].values()) >= 6
    assert sum(two["served_by_lb"].values()) == 16
