"""The simulator over a topology: MD datacenters behind their own lines, every placement policy on
the same requests, and `pddlink sim --topology` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pddlink.routing import PlacementPolicy
from pddlink.sim.demo_scale import DemoKnobs
from pddlink.sim.deploy import Kind
from pddlink.sim.pools import run_topology, topology_deployment
from pddlink.sim.workload import DEFAULT_WORKLOAD, load_workload
from pddlink.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "topology" / "three-dc.toml"
KNOBS = DemoKnobs(requests=120, warmup=16)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return run_topology(load_topology(EXAMPLE), load_workload(DEFAULT_WORKLOAD), KNOBS, list(PlacementPolicy))


def test_the_example_becomes_two_decode_sites_with_their_own_lines() -> None:
    d = topology_deployment(load_topology(EXAMPLE), KNOBS, PlacementPolicy.ROUND_ROBIN)
    assert d.kind is Kind.PDD and (d.prefill.instances, d.relay and d.relay.instances) == (2, 2)
    assert [(s.datacenter, s.names) for s in d.sites] == [
        ("dc-b", ("md-b0", "md-b1")),
        ("dc-c", ("md-c0", "md-c1")),
    ]
    b, c = (s.link for s in d.sites)
    assert (b.wan_gbps, b.rtt_s, c.wan_gbps, c.rtt_s) == (0.016, 0.02, 0.008, 0.04)
    assert d.placement is PlacementPolicy.ROUND_ROBIN


def test_round_robin_spreads_evenly_and_every_policy_finishes(result: dict[str, Any]) -> None:
    pol = result["policies"]
    assert set(pol) == {p.value for p in PlacementPolicy}
    assert pol["round_robin"]["md_requests_by_instance"] == {
        "md-b0": 30,
        "md-b1": 30,
        "md-c0": 30,
        "md-c1": 30,
    }
    for f in pol.values():
        assert f["requests"] == 120 and f["unfinished"] == 0
        assert set(f["wan_bytes_by_link"]) == {"dc-a->dc-b", "dc-a->dc-c"}
        assert f["wan_bytes"] == sum(f["wan_bytes_by_link"].values())
    assert result["links"] == {
        "dc-a->dc-b": {"line_mbit": 16.0, "rtt_ms": 20.0},
        "dc-a->dc-c": {"line_mbit": 8.0, "rtt_ms": 40.0},
    }


def test_prefix_aware_beats_round_robin_and_nears_the_oracle(result: dict[str, Any]) -> None:
    pol = result["policies"]
    aware, rr = pol["prefix_aware"], pol["round_robin"]
    assert aware["md_hit_rate"] > rr["md_hit_rate"] + 0.2
    assert aware["wan_bytes"] < 0.6 * rr["wan_bytes"]
    assert aware["ttft_s"]["p90"] < rr["ttft_s"]["p90"]
    assert result["oracle_md_hit_rate"] == pol["oracle"]["md_hit_rate"]
    assert abs(result["oracle_md_hit_rate"] - aware["md_hit_rate"]) <= 0.03


def test_the_same_run_twice_is_the_same() -> None:
    topo, workload = load_topology(EXAMPLE), load_workload(DEFAULT_WORKLOAD)
    small = replace(KNOBS, requests=40)
    one = run_topology(topo, workload, small, [PlacementPolicy.PREFIX_HASH])
    two = run_topology(topo, workload, small, [PlacementPolicy.PREFIX_HASH])
    assert one["policies"] == two["policies"] and set(one["policies"]) == {"prefix_hash", "oracle"}


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pddlink.cli.main", "sim", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_cli_topology_json_and_a_malformed_file(tmp_path: Path) -> None:
    out = _sim("--topology", str(EXAMPLE), "--placement", "round_robin", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data["policies"]) == {"round_robin", "oracle"} and data["topology"] == str(EXAMPLE)
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text().replace('address = "127.0.0.1:7301"', 'address = "a:1,b:2"'))
    out = _sim("--topology", str(bad), "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert 'topology.datacenter[2].md[0].address: expected "host:port", got "a:1,b:2"' in out.stderr
