"""One router over pools (issue 26), as processes with mutual TLS per instance: two P and one RLD
in dc-a, one MD in dc-b and one in dc-c. A request goes to the MD whose own DRC mirror holds its
prefix; with that MD killed, the next ones go to the other MD (finished, exact tokens); with a P
killed, to the other P; /status shows each instance's health, load and mirror size; a drained MD
gets nothing new, a restarted one is placed on again."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from engines_adapter import SamplingParams
from harness.cluster import allowed_cpus, cpu_set, datacenter_cpus
from harness.demo_load import RequestResult, replay
from harness.demo_workload import DemoRequest
from harness.pool_cluster import PoolCluster, PoolSpec
from pddlink.topology import parse_topology
from tests.e2e.test_e2e_pipeline import reference

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOPOLOGY = """
[topology]
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", address = "127.0.0.1:1" }, { name = "p-a1", address = "127.0.0.1:5" }]
rld = [{ name = "rld-a0", address = "127.0.0.1:2" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", address = "127.0.0.1:3" }]
[[topology.datacenter]]
name = "dc-c"
md = [{ name = "md-c0", address = "127.0.0.1:4" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 16
rtt_ms = 20
[[topology.link]]
between = ["dc-a", "dc-c"]
line_mbit = 16
rtt_ms = 20
"""

BASE = tuple((7 * i + 3) % 2000 + 1 for i in range(320))  # a shared 20-block prefix


def _req(i: int, suffix: int) -> DemoRequest:
    prompt = BASE + tuple((suffix * 31 + j) % 2000 + 1 for j in range(24))
    return DemoRequest(i, 0.0, prompt, SamplingParams(seed=50 + i, temperature=0.8, top_k=40, max_tokens=12))


def _run(pools: PoolCluster, reqs: list[DemoRequest], prefix: str) -> list[RequestResult]:
    return asyncio.run(replay(pools.router_target, reqs, deadline_s=20.0, id_prefix=prefix))


def _http(pools: PoolCluster, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    class Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(pools.router_unix)

    conn = Unix("router", timeout=10)
    conn.request(method, path, json.dumps(body).encode() if body is not None else None)
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return resp.status, out


def _instances(pools: PoolCluster) -> dict[str, dict[str, Any]]:
    _, st = _http(pools, "GET", "/status")
    dcs = st["topology"]["datacenters"]
    return {i["name"]: i for dc in dcs for role in ("p", "rld", "md") for i in dc[role]}


def _until(check: Any, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {check()}")


def test_placed_on_the_md_holding_the_prefix_and_away_from_a_dead_one(tmp_path: Path) -> None:
    cpus = datacenter_cpus()  # as the pools demo runs them: the MDs on CPUs of their own
    spec = PoolSpec(tmp_path, parse_topology(TOPOLOGY), placement="prefix_aware", tls=True, cpus=cpus)
    with PoolCluster(spec) as pools:
        for name, proc in pools.procs.items():
            role = "router" if name.startswith("router") else pools.members[name].role.value
            want = dict(cpus).get(role)
            assert allowed_cpus(proc.pid) == (cpu_set(want) if want else allowed_cpus(os.getpid())), name
        first = _run(pools, [_req(0, 0)], "a")[0]
        assert first.outcome == "finished", first.reason
        home = first.trace["placement"]["md"]
        other = "md-c0" if home == "md-b0" else "md-b0"
        _until(lambda: _instances(pools)[home]["mirror_blocks"] >= 20)  # MD's events reached the mirror

        again = _run(pools, [_req(i, i) for i in range(1, 5)], "b")
        assert [r.outcome for r in again] == ["finished"] * 4, [r.reason for r in again]
        assert {r.trace["placement"]["md"] for r in again} == {home}  # every one where its prefix is
        assert all(r.trace["mirror_matched_tokens"] >= 320 for r in again)
        want = reference([_req(i, i) for i in range(1, 5)])
        assert [r.tokens for r in again] == want

        status = _instances(pools)
        assert status[home]["placed"] >= 5 and status[home]["in_placement"]
        assert status[other]["health"]["usable"] and status[other]["mirror_blocks"] == 0

        pools.kill(home)
        _until(lambda: _instances(pools)[home]["out_because"] == "unreachable")
        later = [_req(i, i) for i in range(5, 9)]
        after = _run(pools, later, "c")
        assert [r.outcome for r in after] == ["finished"] * 4, [r.reason for r in after]
        assert {r.trace["placement"]["md"] for r in after} == {other}
        assert [r.tokens for r in after] == reference(later)

        dead_p = after[-1].trace["placement"]["p"]
        pools.kill(dead_p)  # at once: the router has not seen it go yet
        no_p = [_req(i, i) for i in range(10, 14)]
        moved = _run(pools, no_p, "e")
        assert [r.outcome for r in moved] == ["finished"] * 4, [r.reason for r in moved]
        assert dead_p not in {r.trace["placement"]["p"] for r in moved}
        assert [r.tokens for r in moved] == reference(no_p)

        code, drained = _http(pools, "POST", "/admin/drain", {"instance": other})
        assert code == 200 and drained["draining"]
        assert _instances(pools)[other]["out_because"] == "drained"
        code, _ = _http(pools, "POST", "/admin/drain", {"instance": "md-x9"})
        assert code == 404
        pools.restart(home)
        _until(lambda: _instances(pools)[home]["in_placement"])  # back once healthy
        back = _run(pools, [_req(9, 9)], "d")[0]
        assert back.outcome == "finished"
        assert back.trace["placement"]["md"] == home  # the drained one gets none
