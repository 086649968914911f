"""The simulator over a topology: ``pddlink sim --topology F``, at the scale of ``pddlink demo``.

``topology_deployment`` turns a ``pddlink.topology.Topology`` into a ``Deployment``: its P, RLD and
MD counts at the demo's CPU-engine speeds (``sim.demo_scale``), each MD datacenter a decode site
behind its own WAN link, modelled as the demo runs it (``pddlink demo --topology``, what the
simulator predicts, compared request by request against its ``requests.jsonl``):

- the bytes: the demo's loopback lab shapes every TCP connection on its own at the link's rate and
  RTT, so a site's line is every P's ``wan_links`` connections to every MD there, each able to
  fill the link's rate; the router's view of it (placement, ship or relay): one line of the
  link's rate with a pool of ``wan_links``, its backlog from P's transfer state
  (``DecodeSite.seen``);
- each engine's pool: ``engine_blocks`` (P's own prefix cache; MD's DRC three quarters of it);
  P ships whole blocks.

``run_topology`` replays one demo trace (the same requests for every policy) under each placement
policy as the demo does (``pools_schedule``): the warm-up requests ``warmup_pace_s`` apart, forced
P->MD and placed by the policy being measured (``prefix_hash`` learns from them, round robin's
turn moves on), all finished before the measured requests start. It reports, per policy: TTFT
P50/P90/P99, the MD hit rate (mean share of each measured prompt its MD already held) overall and
per instance, requests per instance, WAN bytes per link and in total, and the RLD token share; and
the oracle's hit rate. ``request_rows`` and ``agreement`` set its per-request records beside the
demo's.
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
from pddlink.routing import Option, PlacementPolicy
from pddlink.sim.demo_scale import DemoKnobs, demo_deployments, demo_trace, pools_schedule
from pddlink.sim.deploy import DecodeSite, Deployment, Kind, Link, Pool
from pddlink.sim.engine import Simulation
from pddlink.sim.hardware import GPU_A
from pddlink.sim.records import RunRecords, percentiles
from pddlink.sim.trace import TraceRequest
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
        # The demo's lab shapes each TCP connection on its own at the link's rate (netlab's loopback
        # relay), so what carries the bytes is every P's ``wan_links`` connections to every MD there,
        # each at the line rate; the router models one line of that rate with a pool of
        # ``wan_links`` (``router.fleet``).
        conns = len(topo.members(Role.P)) * len(dc.md) * knobs.wan_links
        line = Link(wan_gbps=gbps * conns, rtt_s=link.rtt_s, pool_size=conns, flow_cap_gbps=gbps,
                    fast_gbps=10.0, fast_setup_s=0.002)  # fmt: skip
        seen = Link(wan_gbps=gbps, wan_efficiency=1.0, rtt_s=link.rtt_s, pool_size=knobs.wan_links,
                    flow_cap_gbps=gbps)  # fmt: skip
        sites.append(DecodeSite(dc.name, tuple(i.name for i in dc.md), line, seen))
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
        drc_tokens_per_gpu=knobs.engine_blocks * 3 // 4 * knobs.block_tokens,  # MD's DRC: 3/4 of its pool
        p_cache_blocks=knobs.engine_blocks,
        whole_blocks=True,
        router_loads=True,
        policy=replace(base.policy, rld_token_budget=knobs.rld_token_budget),
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


def request_rows(records: RunRecords, requests: Sequence[TraceRequest]) -> list[dict[str, Any]]:
    """Per measured request (``requests``, in the order they were replayed, the last of
    ``records``): what ``pddlink demo --topology`` records of each in its ``requests.jsonl``, to
    set the two side by side (``agreement``): its MD, option, the prompt's tokens MD held, TTFT."""
    rows = []
    for i, (r, rec) in enumerate(zip(requests, records.records[-len(requests) :], strict=True)):
        rows.append(
            {
                "index": i,
                "md": rec.decode,
                "option": rec.option.value if rec.option else "rejected",
                "prompt_tokens": r.prompt_tokens,
                "md_cached_tokens": r.prompt_tokens - rec.missing_tokens,
                "ttft_s": round(rec.first_token_s - rec.arrival_s, 4) if rec.first_token_s >= 0 else None,
            }
        )
    return rows


def agreement(measured: Sequence[dict[str, Any]], predicted: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How alike two per-request records of the same requests are (rows as ``request_rows``
    writes them, matched by ``index``): the share placed on the same MD and given the same
    option, and the mean absolute difference of the share of each prompt MD held."""
    sim = {r["index"]: r for r in predicted}
    both = [(m, sim[m["index"]]) for m in measured if m["index"] in sim]
    if not both:
        return {"requests": 0, "same_md": None, "same_option": None, "hit_abs_diff": None}

    def held(r: dict[str, Any]) -> float:
        return min(1.0, r["md_cached_tokens"] / r["prompt_tokens"]) if r["prompt_tokens"] else 0.0

    n = len(both)
    return {
        "requests": n,
        "same_md": round(sum(m["md"] == s["md"] for m, s in both) / n, 4),
        "same_option": round(sum(m["option"] == s["option"] for m, s in both) / n, 4),
        "hit_abs_diff": round(sum(abs(held(m) - held(s)) for m, s in both) / n, 4),
    }


def run_topology(
    topo: Topology,
    workload: Workload,
    knobs: DemoKnobs,
    policies: Sequence[PlacementPolicy],
    progress: Callable[[str], None] | None = None,
    per_request: bool = False,
) -> dict[str, Any]:
    """Every policy in ``policies`` (and the oracle) on the same demo trace, as the demo replays
    it (``pools_schedule``): the warm-up forced P->MD through the policy and run to its end, then
    the measured requests. ``per_request``: each policy's figures carry ``request_rows`` too."""
    started = time.perf_counter()
    warm, measured = pools_schedule(demo_trace(workload, knobs), knobs)
    p_dc = topo.members(Role.P)[0].datacenter
    wanted = list(dict.fromkeys([*policies, PlacementPolicy.ORACLE]))
    figures: dict[str, Any] = {}
    for policy in wanted:
        if progress:
            progress(f"simulating placement {policy.value} ({len(warm)} + {len(measured)} requests) ...")
        sim = Simulation(topology_deployment(topo, knobs, policy), knobs.block_tokens)
        t0 = sim.settle(warm, Option.SHIP)
        records = sim.run([replace(r, arrival_s=t0 + r.arrival_s) for r in measured], warmup_s=t0)
        figures[policy.value] = policy_figures(records, p_dc)
        if per_request:
            figures[policy.value]["per_request"] = request_rows(records, measured)
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
