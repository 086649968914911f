"""The simulator over a topology: MD datacenters behind their own lines, every placement policy on
the same requests, and `pddlink sim --topology` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pddlink.routing import Option, PlacementPolicy
from pddlink.sim.demo_scale import DemoKnobs, demo_trace, pools_schedule
from pddlink.sim.deploy import Kind
from pddlink.sim.engine import Simulation
from pddlink.sim.pools import agreement, run_topology, topology_deployment
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
    # the bytes: 2 P x 2 MD x 2 connections per site, each shaped alone at the link's rate
    b, c = (s.link for s in d.sites)
    assert (b.wan_gbps, b.flow_cap_gbps, b.pool_size, b.rtt_s) == pytest.approx((0.128, 0.016, 8, 0.02))
    assert (c.wan_gbps, c.flow_cap_gbps, c.pool_size, c.rtt_s) == pytest.approx((0.064, 0.008, 8, 0.04))
    # the router's view: one line of the link's rate, a pool of P's 2 connections
    seen = [s.seen for s in d.sites]
    assert [(x.wan_bytes_s, x.pool_size, x.rtt_s) for x in seen if x] == [(2e6, 2, 0.02), (1e6, 2, 0.04)]
    assert d.placement is PlacementPolicy.ROUND_ROBIN and d.p_cache_blocks == 4096 and d.whole_blocks


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


def test_p_ships_whole_blocks(result: dict[str, Any]) -> None:
    """The demo's P sends every block MD lacks at full size: each transfer, so each link's sum, is
    a whole number of 16-token blocks of 2048 bytes per token."""
    block = KNOBS.block_tokens * KNOBS.kv_bytes_per_token
    for f in result["policies"].values():
        assert all(n % block == 0 for n in f["wan_bytes_by_link"].values())
        assert f["wan_bytes"] > 0


def test_the_warm_up_is_paced_forced_and_over_before_the_measured_requests() -> None:
    """As ``pddlink demo --topology`` sends it: 0.4 s apart, P->MD, all landed first. Round robin
    puts warm-up request k on MD k % 4, so each MD holds exactly its four prompts."""
    topo, workload = load_topology(EXAMPLE), load_workload(DEFAULT_WORKLOAD)
    warm, measured = pools_schedule(demo_trace(workload, KNOBS), KNOBS)
    assert [r.arrival_s for r in warm] == pytest.approx([0.4 * k for k in range(16)])
    assert len(measured) == 120 and measured[0].arrival_s == 0.0
    sim = Simulation(topology_deployment(topo, KNOBS, PlacementPolicy.ROUND_ROBIN), KNOBS.block_tokens)
    t0 = sim.settle(warm, Option.SHIP)
    assert t0 >= warm[-1].arrival_s and {r.option for r in sim.records.records} == {Option.SHIP}
    assert all(not r.measured and r.finish_s >= 0 for r in sim.records.records)
    for k, cache in enumerate(sim.caches):
        mine = [r for j, r in enumerate(warm) if j % 4 == k]
        full = [r.block_ids[: r.prompt_tokens // KNOBS.block_tokens] for r in mine]
        assert all(cache.matched_blocks(h) == len(h) for h in full)


def test_the_router_sees_its_own_line_and_every_transfer_p_reports() -> None:
    """Placement and the relay choice read the router's model of the link (its rate, a pool of
    2), fed the bytes really in flight, a transfer it never admitted (one that outlived its
    request) included; the line itself carries them at the connections' total rate."""
    sim = Simulation(
        topology_deployment(load_topology(EXAMPLE), KNOBS, PlacementPolicy.PREFIX_AWARE), KNOBS.block_tokens
    )
    idle = sim.line_view(0, 0.0)
    assert (idle.line_bytes_per_s, idle.pool_size, idle.flows_in_flight, idle.backlog_bytes) == (2e6, 2, 0, 0)
    lingering = SimpleNamespace(rid="gone")
    sim.lines[0].send(4_000_000, 0.0, lambda t, arg: None, lingering)
    seen = sim.line_view(0, 0.6)  # P's next report
    assert seen.flows_in_flight == 1 and 0 < seen.backlog_bytes < 4_000_000
    assert seen.transfer_s(2_000_000) > 2.0  # at the router's rate: the line's 16 Mbit/s


def test_request_rows_and_agreement(result: dict[str, Any]) -> None:
    topo, workload = load_topology(EXAMPLE), load_workload(DEFAULT_WORKLOAD)
    got = run_topology(
        topo, workload, replace(KNOBS, requests=30), [PlacementPolicy.ROUND_ROBIN], per_request=True
    )
    rows = got["policies"]["round_robin"]["per_request"]
    assert [r["index"] for r in rows] == list(range(30))
    assert [r["md"] for r in rows[:4]] == ["md-b0", "md-b1", "md-c0", "md-c1"]  # after 16 warm-up turns
    assert all(0 <= r["md_cached_tokens"] <= r["prompt_tokens"] and r["ttft_s"] > 0 for r in rows)
    assert agreement(rows, rows) == {"requests": 30, "same_md": 1.0, "same_option": 1.0, "hit_abs_diff": 0.0}
    other = [dict(r, md="md-x", md_cached_tokens=0) if r["index"] < 3 else r for r in rows]
    off = sum(min(1.0, r["md_cached_tokens"] / r["prompt_tokens"]) for r in rows[:3]) / 30
    assert agreement(other, rows) == {
        "requests": 30,
        "same_md": 0.9,
        "same_option": 1.0,
        "hit_abs_diff": round(off, 4),
    }
    assert agreement([], rows)["requests"] == 0


def test_an_rld_budget_keeps_a_placement_that_misses_from_relaying_its_way_out() -> None:
    """RLD is a small tier: under a token budget, round robin (which misses the caches) can no
    longer relay most requests and ships its large suffixes instead, while prefix-aware placement
    (which hits) stays below the budget and keeps its first tokens. The simulator's no-deadline
    shortcut (``choose_pipeline``) knows no budget, so a budget must take ``choose_option``."""
    topo, workload = load_topology(EXAMPLE), load_workload(DEFAULT_WORKLOAD)
    policies = [PlacementPolicy.PREFIX_AWARE, PlacementPolicy.ROUND_ROBIN]
    free = run_topology(topo, workload, replace(KNOBS, rld_token_budget=1.0), policies)["policies"]
    held = run_topology(topo, workload, replace(KNOBS, rld_token_budget=0.25), policies)["policies"]
    assert free["round_robin"]["rld_token_share"] > 0.3  # unbounded, round robin relays its misses
    assert held["round_robin"]["rld_token_share"] < free["round_robin"]["rld_token_share"] - 0.05
    assert held["prefix_aware"]["rld_token_share"] < 0.25
    assert held["prefix_aware"]["ttft_s"] == free["prefix_aware"]["ttft_s"]  # the budget never bit
    assert held["round_robin"]["ttft_s"]["p90"] > free["round_robin"]["ttft_s"]["p90"]
    assert held["prefix_aware"]["ttft_s"]["p90"] < held["round_robin"]["ttft_s"]["p90"]
