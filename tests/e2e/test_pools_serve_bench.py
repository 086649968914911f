"""vLLM's own benchmark client as the load on the router over pools (issue 26, item 7;
``pddlink bench vllm-serve --topology F``, ``harness.pools_serve_bench``): one P and one RLD in
dc-a, one MD in dc-b and one in dc-c, each policy on a fresh deployment with the same shared-prefix
requests. Every request completes under both policies; round robin spreads the requests over both
MDs, so each prefix crosses both links; placement by each MD's own mirror sends a prefix back to
the MD that holds it: a higher DRC hit and fewer WAN bytes than round robin's, from the MD
sidecars' own counters."""

from __future__ import annotations

import pytest

from harness.pools_serve_bench import PoolsBenchSpec, pools_figures, run
from pddlink.topology import parse_topology

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(400)]

TOPOLOGY = """
[topology]
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", address = "127.0.0.1:1" }]
rld = [{ name = "rld-a0", address = "127.0.0.1:2" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", address = "127.0.0.1:3" }]
[[topology.datacenter]]
name = "dc-c"
md = [{ name = "md-c0", address = "127.0.0.1:4" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 32
rtt_ms = 10
[[topology.link]]
between = ["dc-a", "dc-c"]
line_mbit = 32
rtt_ms = 10
"""


def test_per_link_and_per_md_figures_add_up() -> None:
    topo = parse_topology(TOPOLOGY)
    got = pools_figures(
        topo,
        {
            "md-b0": {"wan_bytes": 300.0, "hit_blocks": 3.0, "lookup_blocks": 4.0},
            "md-c0": {"wan_bytes": 100.0, "hit_blocks": 0.0, "lookup_blocks": 4.0},
        },
    )
    assert got["wan_bytes_by_link"] == {"dc-a->dc-b": 300, "dc-a->dc-c": 100}
    assert got["wan_bytes"] == 400
    assert got["md_hit_rate"] == 0.375
    assert got["md_hit_rate_by_instance"] == {"md-b0": 0.75, "md-c0": 0.0}


def test_vllm_bench_serve_over_pools_per_policy() -> None:
    pytest.importorskip("vllm.benchmarks.serve", reason="vLLM is not installed")
    spec = PoolsBenchSpec(
        prompts=16, prefix_len=256, suffix_len=32, prefixes=4, output_len=8, request_rate=4.0,
        concurrency=8, policies=("round_robin", "prefix_aware"),
    )  # fmt: skip
    out = run(spec, parse_topology(TOPOLOGY), "inline")
    rr, pl = out["policies"]["round_robin"], out["policies"]["placement"]
    for row in (rr, pl):
        assert (row["completed"], row["failed"]) == (16, 0), row["errors"]
        assert row["output_tokens"] == 16 * 8
    assert out["errors"] == 0
    assert sum(rr["router_pipelines"].values()) == 16  # the router's own count (its /metrics, with the key)
    assert all(n > 0 for n in rr["md_lookups_by_instance"].values())  # both MDs served round robin
    assert pl["md_hit_rate"] > rr["md_hit_rate"]
    assert pl["wan_bytes"] < rr["wan_bytes"]
    assert pl["ratio_to_round_robin"]["wan_bytes"] < 1.0
