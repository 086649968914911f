"""The simulator over a topology: ``pddlink sim --topology F``, at the scale of ``pddlink demo``.

``topology_deployment`` turns a ``pddlink.topology.Topology`` into a ``Deployment``: its P, RLD and
MD counts at the demo's CPU-engine speeds (``sim.demo_scale``), each MD datacenter a decode site
behind its own WAN line (the topology link's rate and RTT; the demo's 4-connection pool, each
connection able to fill the line). ``run_topology`` replays one demo trace (the same requests for
every policy) under each placement policy and reports, per policy: TTFT P50/P90/P99, the MD hit
rate (mean share of each measured prompt its MD already held) overall and per instance, requests
per instance, WAN bytes per link and in total, and the RLD token share; and the oracle's hit rate.
The warm-up requests run through the policy being measured (as ``pddlink demo --warmup`` sends them
through the router), so ``prefix_hash`` learns from them as it would.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from pddlink.errors import ConfigError
from pddlink.roles import Role
from pddlink.routing import PlacementPolicy
from pddlink.sim.demo_scale import DemoKnobs, demo_deployments, demo_trace, measured_from_s
from pddlink.sim.deploy import DecodeSite, Deployment, Kind, Link, Pool
from pddlink.sim.engine import Simulation
from pddlink.sim.hardware import GPU_A
from pddlink.sim.records import RunRecords, percentiles
from pddlink.sim.workload import Workload
from pddlink.topology import Topology


def topology_deployment(topo: Topology, knobs: DemoKnobs, policy: PlacementPolicy) -> Deployment:
    """``topo`` at the demo's scale, placed by ``policy``. P must sit in one datacenter (the
    simulator's P pool is one) and every MD across a WAN link from it."""
    p_dcs = {m.datacenter for m in topo.members(Role.P)}
    if len(p_dcs) != 1:
        raise ConfigError(f"sim --topology: P must sit in one datacenter, found {sorted(p_dcs)}")
    (p_dc,) = p_dcs
    sites = []
    for dc in topo.datacenters:
        if not dc.md:
            continue
        link = topo.link(p_dc, dc.name)
        if link is None:
            raise ConfigError(f"sim --topology: MD in {dc.name} beside P: the simulator needs a WAN link")
        gbps = link.line_mbit / 1000
        line = Link(wan_gbps=gbps, rtt_s=link.rtt_s, pool_size=4, flow_cap_gbps=gbps, fast_gbps=10.0,
                    fast_setup_s=0.002)  # fmt: skip
        sites.append(DecodeSite(dc.name, tuple(i.name for i in dc.md), line))
    base = demo_deployments(knobs)[-1]  # PDD at demo scale: its figures, RLD batch and policy
    n_rld = len(topo.members(Role.RLD))
    return replace(
        base,
        name=policy.value,
        kind=Kind.PDD if n_rld else Kind.CROSS_DC_PD,
        prefill=Pool(GPU_A, 1, len(topo.members(Role.P))),
        decode=Pool(GPU_A, 1, len(topo.members(Role.MD))),
        relay=Pool(GPU_A, 1, n_rld) if n_rld else None,
        link=sites[0].link,
        sites=tuple(sites),
        placement=policy,
        prefill_datacenter=p_dc,
    )


def policy_figures(records: RunRecords, p_dc: str) -> dict[str, Any]:
    """One policy's figures from its run (see the module docstring)."""
    recs = records.measured()
    ttft = np.array([r.first_token_s - r.arrival_s for r in recs])
    by_md: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        by_md[r.decode].append(r.hit)
    out_tokens = sum(r.output_tokens for r in recs)
    wan = {f"{p_dc}->{dc}": n for dc, n in records.wan_bytes.items()}
    return {
        "requests": len(recs),
        "unfinished": sum(1 for r in records.records if r.measured and r.finish_s < 0 and not r.rejected),
        "ttft_s": percentiles(ttft),
        "md_hit_rate": round(float(np.mean([r.hit for r in recs])), 4) if recs else 0.0,
        "md_hit_rate_by_instance": {md: round(float(np.mean(h)), 4) for md, h in sorted(by_md.items())},
        "md_requests_by_instance": {md: len(h) for md, h in sorted(by_md.items())},
        "wan_bytes": sum(wan.values()),
        "wan_bytes_by_link": wan,
        "rld_token_share": round(sum(r.rld_tokens for r in recs) / out_tokens, 4) if out_tokens else 0.0,
    }


def run_topology(
    topo: Topology,
    workload: Workload,
    knobs: DemoKnobs,
    policies: Sequence[PlacementPolicy],
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every policy in ``policies`` (and the oracle) on the same demo trace."""
    started = time.perf_counter()
    trace = demo_trace(workload, knobs)
    warm_s = measured_from_s(trace, knobs)
    p_dc = topo.members(Role.P)[0].datacenter
    wanted = list(dict.fromkeys([*policies, PlacementPolicy.ORACLE]))
    figures: dict[str, Any] = {}
    for policy in wanted:
        if progress:
            progress(f"simulating placement {policy.value} ({len(trace.requests)} requests) ...")
        d = topology_deployment(topo, knobs, policy)
        records = Simulation(d, knobs.block_tokens).run(trace.requests, warmup_s=warm_s)
        figures[policy.value] = policy_figures(records, p_dc)
    return {
        "policies": figures,
        "oracle_md_hit_rate": figures[PlacementPolicy.ORACLE.value]["md_hit_rate"],
        "links": {
            f"{p_dc}->{k.b if k.a == p_dc else k.a}": {"line_mbit": k.line_mbit, "rtt_ms": k.rtt_ms}
            for k in topo.links
            if p_dc in (k.a, k.b)
        },
        "knobs": {f: getattr(knobs, f) for f in knobs.__dataclass_fields__},
        "wall_s": round(time.perf_counter() - started, 2),
    }
