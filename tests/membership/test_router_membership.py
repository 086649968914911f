"""Membership through a real etcd with real processes (issue 29): a router and a P over a topology of
one P and one MD, every sidecar announcing itself, mutual TLS everywhere.

- an MD that only announces itself in etcd (not in the file), under a steady load, gets its first
  request within 5 s, without a restart of the router or of P, and every request finishes with
  exact tokens;
- a record anyone could write (an identity whose certificate the peer at that address does not
  hold) joins the membership but never placement, and no request goes there; one that repeats a
  member's address is refused outright;
- kill -9 of the added MD: it leaves placement within its lease TTL, nothing is placed on it after;
- etcd stopped: the router keeps serving on the last membership and says so in /status.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _etcd_server import EtcdServer

from engines_adapter import SamplingParams
from harness.demo_load import RequestResult, replay
from harness.demo_workload import DemoRequest
from harness.pool_cluster import PoolCluster, PoolSpec
from pddlink.membership import MemberAddresses, MemberRecord, MembershipKeys, encode_record
from pddlink.membership.etcd import EtcdConfig, EtcdSession
from pddlink.roles import Role
from pddlink.topology import parse_topology
from pddlink.wire import WIRE_VERSION
from tests.e2e.test_e2e_pipeline import reference

pytestmark = [pytest.mark.e2e, pytest.mark.fleet, pytest.mark.timeout(300)]

TOPOLOGY = """
[topology]
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", address = "127.0.0.1:1" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", address = "127.0.0.1:3" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 100
rtt_ms = 2
"""
TTL_S = 3


def _req(i: int) -> DemoRequest:
    prompt = tuple((i * 131 + j * 7) % 2000 + 1 for j in range(48))
    return DemoRequest(i, 0.0, prompt, SamplingParams(seed=70 + i, temperature=0.8, top_k=40, max_tokens=8))


def _run(pools: PoolCluster, reqs: list[DemoRequest], prefix: str) -> list[RequestResult]:
    return asyncio.run(replay(pools.router_target, reqs, deadline_s=20.0, id_prefix=prefix, pipeline="p_md"))


def _status(pools: PoolCluster) -> dict[str, Any]:
    with urllib.request.urlopen(pools.router_url() + "/status", timeout=5) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


def _in_placement(pools: PoolCluster) -> dict[str, bool]:
    dcs = _status(pools)["topology"]["datacenters"]
    return {i["name"]: i["in_placement"] for dc in dcs for i in dc["md"]}


def _placed(pools: PoolCluster) -> dict[str, int]:
    dcs = _status(pools)["topology"]["datacenters"]
    return {i["name"]: i["placed"] for dc in dcs for i in dc["md"]}


def _until(check: Any, timeout_s: float) -> float:
    """Seconds until ``check()`` is true; AssertionError after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if check():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s")


async def _rogue(etcd: EtcdServer, cluster: str, grpc_address: str, name: str = "md-rogue") -> None:
    """A record a stranger wrote (no lease): it names md/md-rogue at an address that serves TLS with
    a certificate of the deployment's CA, but one naming router/router0 (the router's gRPC port)."""
    record = MemberRecord(
        role=Role.MD,
        datacenter="dc-b",
        name=name,
        addresses=MemberAddresses(grpc=grpc_address, kv=grpc_address),
        identity=f"md/{name}",
        engine="reference",
        wire_version=WIRE_VERSION,
    )
    keys = MembershipKeys(cluster)
    session = EtcdSession(EtcdConfig.parse(etcd.endpoint))
    try:
        await session.call(session.client.put(keys.key_for(record), encode_record(record)))
    finally:
        await session.close()


def test_members_join_leave_and_outlive_etcd(tmp_path: Path, own_etcd: EtcdServer) -> None:
    spec = PoolSpec(
        tmp_path, parse_topology(TOPOLOGY), placement="round_robin", relay=False, etcd=own_etcd.endpoint,
        ttl_s=TTL_S,
    )  # fmt: skip
    with PoolCluster(spec) as pools:
        assert _status(pools)["membership"]["stale"] is False

        # an MD the file does not name announces itself under a steady load (2.5 requests/s): it
        # receives requests within 5 s, without a restart; the load's requests all finish exactly
        steady = [replace(_req(100 + i), arrival_s=0.4 * i) for i in range(40)]
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(_run, pools, steady, "s")
            time.sleep(2.0)  # the load is under way
            pools.add_sidecar("md-b1", Role.MD, "dc-b")  # returns once it serves (and has announced itself)
            joined = _until(lambda: _placed(pools).get("md-b1", 0) > 0, 10.0)
            assert joined < 5.0, f"md-b1 got its first request {joined:.1f} s after it announced itself"
            during = load.result(timeout=120)
        assert [r.outcome for r in during] == ["finished"] * len(steady), [r.reason for r in during]
        assert [r.tokens for r in during] == reference(steady)
        assert {r.trace["placement"]["md"] for r in during} == {"md-b0", "md-b1"}
        reqs = [_req(i) for i in range(4)]
        got = _run(pools, reqs, "a")
        assert [r.outcome for r in got] == ["finished"] * 4, [r.reason for r in got]
        placed = [r.trace["placement"]["md"] for r in got]
        assert "md-b1" in placed and "md-b0" in placed, placed
        assert [r.tokens for r in got] == reference(reqs)

        # a record a stranger wrote: listed by the watcher, never in placement, no request there
        asyncio.run(_rogue(own_etcd, spec.cluster, f"127.0.0.1:{pools.router_port}"))
        _until(lambda: "md-rogue" in _status(pools)["membership"]["joined"], 5.0)
        assert _in_placement(pools)["md-rogue"] is False  # not before its handshake proves md/md-rogue
        grpc_b0 = pools.fleet().member("md-b0").instance.address
        asyncio.run(_rogue(own_etcd, spec.cluster, grpc_b0, name="md-twin"))
        _until(lambda: "md/md-twin" in _status(pools)["membership"]["refused"], 5.0)
        time.sleep(1.5)  # the rogue's channel tried (and failed) its handshake meanwhile
        assert _in_placement(pools)["md-rogue"] is False
        got = _run(pools, [_req(10 + i) for i in range(4)], "b")
        assert {r.trace["placement"]["md"] for r in got} <= {"md-b0", "md-b1"}
        assert _in_placement(pools)["md-rogue"] is False
        assert all(r.outcome == "finished" for r in got), [r.reason for r in got]

        # kill -9: out of placement within the lease's TTL, nothing placed there afterwards
        pools.kill("md-b1")
        t_kill = time.monotonic()
        _until(lambda: "md-b1" not in _in_placement(pools) or not _in_placement(pools)["md-b1"], TTL_S + 2.0)
        left = time.monotonic() - t_kill
        assert left <= TTL_S + 1.0, f"md-b1 left placement {left:.1f} s after kill -9 (TTL {TTL_S} s)"
        _until(lambda: "md-b1" not in _status(pools)["membership"]["joined"], TTL_S + 3.0)
        got = _run(pools, [_req(20 + i) for i in range(4)], "c")
        assert [r.trace["placement"]["md"] for r in got] == ["md-b0"] * 4
        assert all(r.outcome == "finished" for r in got), [r.reason for r in got]

        # etcd stopped: the router serves on its last membership and says it is stale
        own_etcd.stop()
        _until(lambda: _status(pools)["membership"]["stale"] is True, 10.0)
        got = _run(pools, [_req(30 + i) for i in range(3)], "d")
        assert all(r.outcome == "finished" for r in got), [r.reason for r in got]
        assert _in_placement(pools)["md-b0"] is True
