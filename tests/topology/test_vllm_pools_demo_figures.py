"""The vLLM pools demo's figures (``harness.vllm_pools_demo.figures``) from a run's traces, P's
status and P's transfer records: requests per MD from the traces' placement, KV bytes and
transfers per link and MD from P's per-instance counts, each MD's DRC hit from the whole blocks it
held when P shipped, the RLD share and handoffs, what the sidecars hold."""

from __future__ import annotations

from types import SimpleNamespace

from harness.vllm_pools_demo import figures, ratios
from pddlink.topology import parse_topology

TOPOLOGY = """
[topology]
engine = "vllm"
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", api_url = "http://127.0.0.1:1" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", api_url = "http://127.0.0.1:2", kv = "127.0.0.1:3" }]
[[topology.datacenter]]
name = "dc-c"
md = [{ name = "md-c0", api_url = "http://127.0.0.1:4", kv = "127.0.0.1:5" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 16
rtt_ms = 20
[[topology.link]]
between = ["dc-a", "dc-c"]
line_mbit = 8
rtt_ms = 40
"""


def _done(md: str, rld: int, main: int, handoff: str = "") -> SimpleNamespace:
    trace = {"placement": {"md": md}, "tokens": {"rld": rld, "md": main}}
    if handoff:
        trace |= {"handoff_outcome": "handed_off", "handoff_mode": handoff}
    return SimpleNamespace(trace=trace)


def test_figures_per_md_and_per_link() -> None:
    topo = parse_topology(TOPOLOGY)
    run = {
        "done": [_done("md-b0", 10, 0), _done("md-b0", 4, 6, "one_shot"), _done("md-c0", 0, 10)],
        "failed": ["x: md_lost"],
        "ttft": [0.1, 0.2, 0.3],
        "divergences": [],
    }
    idle = {"held_slots": 0, "held_bytes": 0, "in_flight": 0}
    status = {
        "p-a0": {**idle, "instances": {"md-b0": {"shipped": 2, "failed": 0, "bytes": 300},
                                       "md-c0": {"shipped": 1, "failed": 1, "bytes": 100}}},
        "md-b0": idle,
        "md-c0": idle,
    }  # fmt: skip
    records = {
        "p-a0": {
            "t1": {"legs": {"md": {"instance": "md-b0", "first_block": 0, "num_blocks": 4}}},
            "t2": {"legs": {"md": {"instance": "md-b0", "first_block": 4, "num_blocks": 8}}},
            "t3": {"legs": {"md": {"instance": "md-c0", "first_block": 1, "num_blocks": 4}}},
            "t4": {"legs": {"rld": {"instance": "rld-a0", "first_block": 0, "num_blocks": 4}}},
        }
    }
    f = figures(topo, run, status, records, ["p-a0"])
    assert f["requests"] == 4 and f["failed"] == 1
    assert f["md_requests_by_instance"] == {"md-b0": 2, "md-c0": 1}
    assert f["wan_bytes_by_link"] == {"dc-a->dc-b": 300, "dc-a->dc-c": 100}
    assert f["wan_bytes"] == 400
    assert f["md_transfers_by_instance"]["md-c0"] == {"shipped": 1, "failed": 1}
    assert f["md_hit_rate_by_instance"] == {"md-b0": 0.3333, "md-c0": 0.25}
    assert f["md_hit_rate"] == 0.3125  # 5 of 16 whole blocks
    assert f["rld_token_share"] == 0.4667  # 14 of 30 tokens
    assert f["handoffs"] == {"one_shot": 1, "catch_up": 0}
    assert f["held"]["p-a0"] == idle


def test_ratios_to_round_robin() -> None:
    row = {"ttft_s": {"p50": 1.0, "p90": 2.0, "p99": 3.0}, "wan_bytes": 50}
    base = {"ttft_s": {"p50": 2.0, "p90": 4.0, "p99": 0.0}, "wan_bytes": 100}
    assert ratios(row, base) == {"ttft_p50": 0.5, "ttft_p90": 0.5, "ttft_p99": None, "wan_bytes": 0.5}
