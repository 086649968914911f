"""A fleet that does not stop (issue 29), at a small scale with real processes, a real etcd, a real
HAProxy and mutual TLS (``harness.demo_rolling``: what ``pddlink demo --rolling-restart`` and
``--etcd-outage-s`` run):

- a rolling restart of every process (two routers, two P, an RLD, two MD), one at a time, SIGTERM
  then started again on its ports, under a steady load through HAProxy: every process stops by
  itself on SIGTERM and serves again; no request hangs, every finished one has exactly the tokens
  one engine generates alone, at most 1% fail (each with its reason);
- etcd stopped under the same load: every router says its membership is stale and keeps placing on
  the last one, an MD only etcd made known among it; nothing fails that the same load without the
  outage did not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _etcd_server import etcd_binary

from harness.cluster import ClusterError
from harness.demo_rolling import JOINED_MD, Scenario, main
from harness.lb import haproxy_binary
from pddlink.topology import parse_topology

pytestmark = [pytest.mark.e2e, pytest.mark.fleet, pytest.mark.timeout(1200)]

TOPOLOGY = """
[topology]
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", address = "127.0.0.1:1" }, { name = "p-a1", address = "127.0.0.1:2" }]
rld = [{ name = "rld-a0", address = "127.0.0.1:3" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", address = "127.0.0.1:4" }, { name = "md-b1", address = "127.0.0.1:5" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 16
rtt_ms = 20
"""


@pytest.fixture(autouse=True)
def _binaries() -> None:
    etcd_binary()  # skips without etcd (fails with PDDLINK_REQUIRE_ETCD=1)
    try:
        haproxy_binary()
    except ClusterError as exc:
        pytest.skip(str(exc))


def test_rolling_restart_of_every_process_under_load(tmp_path: Path) -> None:
    out = tmp_path / "rolling.json"
    doc = main(topology=parse_topology(TOPOLOGY), topology_path="inline",
               scenario=Scenario(routers=2, rolling_restart=True, etcd_outage_s=0.0, rate_rps=2.0),
               workload=None, json_path=str(out), plot_path=None, seed=3, warmup=4)  # fmt: skip
    roll = doc["rolling_restart"]
    steps, load = roll["restarts"], roll["load"]
    order = ["router", "router1", "p-a0", "p-a1", "rld-a0", "md-b0", "md-b1"]
    assert [s["process"] for s in steps] == order
    assert [s["exit_code"] for s in steps] == [0] * len(order)  # each stopped by itself, none killed
    assert all(s["serving_s"] > s["ready_s"] >= s["exit_s"] > s["term_s"] for s in steps)
    assert all(s["during"] > 0 for s in steps), "a restart with no request running through it"
    assert load["requests"] >= 50 and load["hung"] == 0 and load["token_mismatches"] == 0
    assert load["failed"] <= 0.01 * load["requests"], load["failure_reasons"]
    assert set(load["served_by_router"]) == {"router0", "router1"}
    assert Path(roll["plot"]).stat().st_size > 0 and out.exists()


def test_etcd_outage_under_load_fails_nothing_more(tmp_path: Path) -> None:
    out = tmp_path / "outage.json"
    doc = main(topology=parse_topology(TOPOLOGY), topology_path="inline",
               scenario=Scenario(routers=2, rolling_restart=False, etcd_outage_s=12.0, rate_rps=2.0),
               workload=None, json_path=str(out), plot_path=None, seed=5, warmup=4,
               placement="round_robin")  # fmt: skip
    o = doc["etcd_outage"]
    for run in (o["baseline"], o["outage"]):
        assert run["requests"] >= 40 and run["hung"] == 0 and run["token_mismatches"] == 0
    assert o["extra_failed"] == 0, (o["baseline"]["failure_reasons"], o["outage"]["failure_reasons"])
    assert all(share > 0 for share in o["stale_seen"].values()), o["stale_seen"]  # each router said so
    assert all(view.get(JOINED_MD) for view in o["in_placement_during"].values())  # the last membership
    assert o["during_outage"]["requests"] > 0 and o["during_outage"]["on_joined_md"] > 0
    assert o["fresh_after_s"] is not None
