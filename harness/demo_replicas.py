"""``pddlink demo --topology F --routers N``: routers as replicas. The pools demo's workload
(``harness.demo_pools``: the same requests, the same warm-up, the same loopback WAN per link) is
replayed twice over the HTTP API, each time on a fresh deployment of the topology:

- ``one``: one router, the client straight to its HTTP port (the deployment as it was);
- ``two`` (``N`` routers; named ``two`` for N = 2, else ``N``): N routers over the same sidecars,
  behind HAProxy (``harness.lb``: round-robin per request, health checks on ``/readyz``).

Every router follows every MD's own DRC events (a mirror per MD, ``router.fleet``), so each places
with the same view of every cache; what one router cannot see is the other's in-flight requests.
Figures per run as the pools demo's (TTFT P50/P90/P99, MD hit rate overall and per instance, WAN
bytes, failures, token mismatches against one engine generating alone), plus the requests each
router served (from the load balancer's counters and from each request's key, which names its
router). JSON: ``{"runs": {"one": {...}, "two": {...}}, "routers": N, ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.demo import reference_tokens, say
from harness.demo_load import RequestResult
from harness.demo_pools import VOCAB, LoopbackWan, figures, md_counters
from harness.demo_workload import DemoRequest, build_trace, demo_requests
from harness.http_replay import replay_http
from harness.lb import HaProxy, haproxy_binary
from harness.pool_cluster import PoolCluster, PoolSpec
from pddlink.roles import Role
from pddlink.topology import Topology


def run_name(routers: int) -> str:
    return {1: "one", 2: "two"}.get(routers, str(routers))


def served_by_key(results: list[RequestResult]) -> dict[str, int]:
    """Requests per router, from each request's key (``<router name>-<random hex>``)."""
    names = Counter(str(r.trace.get("request_key", "")).rsplit("-", 1)[0] for r in results if r.trace)
    return dict(sorted(names.items()))


def run_routers(
    spec: PoolSpec, wan: LoopbackWan, warm: list[DemoRequest], reqs: list[DemoRequest], label: str
) -> tuple[list[RequestResult], dict[str, dict[str, float]], dict[str, Any]]:
    t0 = time.monotonic()
    with PoolCluster(spec, wan) as pools:
        lb = None
        if spec.routers > 1:
            servers = [
                (pools.router_identity(n), "127.0.0.1", pools.router_ports[n][1]) for n in pools.router_names
            ]
            lb = HaProxy.up(spec.run_dir / "lb", servers)
        try:
            url = lb.url if lb is not None else pools.router_url()
            say(
                f"[{label}] {len(pools.members)} sidecars, {spec.routers} router(s) up in "
                f"{time.monotonic() - t0:.1f} s; client -> {'haproxy' if lb else 'router0'} {url}"
            )
            if warm:
                paced = [replace(r, arrival_s=0.4 * i) for i, r in enumerate(warm)]
                w = asyncio.run(replay_http(url, paced, deadline_s=spec.deadline_s, pipeline="p_md"))
                failed = sum(r.outcome != "finished" for r in w)
                say(f"[{label}] warm-up: {len(w)} requests P->MD ({failed} failed)")
            before = md_counters(pools)
            served0 = lb.served() if lb is not None else {}
            t1 = time.monotonic()
            results = asyncio.run(replay_http(url, reqs, deadline_s=spec.deadline_s))
            say(f"[{label}] {len(results)} requests in {time.monotonic() - t1:.1f} s")
            served = {k: v - served0.get(k, 0) for k, v in lb.served().items()} if lb is not None else {}
            time.sleep(1.0)  # shipments that outlive their request land on MD
            after = md_counters(pools)
        finally:
            if lb is not None:
                lb.down()
        with open(spec.run_dir / "requests.jsonl", "w") as f:
            for r in results:
                row = {"index": r.index, "ttft_s": r.ttft_s, "outcome": r.outcome, "reason": r.reason}
                f.write(json.dumps({**row, "trace": r.trace}) + "\n")
    delta = {md: {k: v - before.get(md, {}).get(k, 0.0) for k, v in got.items()} for md, got in after.items()}
    extra = {
        "served_by_lb": served,
        "served_by_key": served_by_key(results),
        "client": "haproxy" if lb else "router",
    }
    return results, delta, extra


def table(doc: dict[str, Any]) -> str:
    lines = [
        f"{'run':>6}  {'TTFT p50':>8} {'p90':>7} {'p99':>7}  {'MD hit':>6}  {'WAN MB':>7}  "
        f"{'failed':>6}  {'mism.':>5}  served"
    ]
    for name, f in doc["runs"].items():
        t = f["ttft_s"]
        lines.append(
            f"{name:>6}  {t['p50']:>8.3f} {t['p90']:>7.3f} {t['p99']:>7.3f}  {f['md_hit_rate']:>6.1%}  "
            f"{f['wan_bytes'] / 1e6:>7.1f}  {f['failed']:>6}  {f['token_mismatches']:>5}  "
            + ", ".join(f"{k} {v}" for k, v in f["served_by_key"].items())
        )
        per_md = f["md_hit_rate_by_instance"].items()
        n_md = f["md_requests_by_instance"]
        lines.append(
            f"{'':>8}per MD (hit, requests): " + ", ".join(f"{md} {h:.0%} ({n_md[md]})" for md, h in per_md)
        )
    one, many = list(doc["runs"].values())[:2]
    lines.append(
        f"hit {one['md_hit_rate']:.3f} -> {many['md_hit_rate']:.3f} "
        f"({(many['md_hit_rate'] - one['md_hit_rate']) * 100:+.1f} points), "
        f"TTFT P90 {many['ttft_s']['p90'] / max(one['ttft_s']['p90'], 1e-9):.2f}x"
    )
    return "\n".join(lines)


def main(
    *,
    topology: Topology,
    topology_path: str,
    routers: int,
    requests: int,
    rate_rps: float,
    workload: str | None,
    json_path: str | None,
    seed: int,
    warmup: int,
    placement: str = "prefix_aware",
) -> dict[str, Any]:
    haproxy_binary()  # before anything starts: a missing load balancer is one clear line
    work = Path(tempfile.mkdtemp(prefix="pddlink-replicas-"))
    every = demo_requests(
        build_trace(
            requests=requests + warmup, rate_rps=rate_rps, seed=seed, workload=workload, trace_file=None
        ),
        vocab_size=VOCAB,
    )
    warm, reqs = every[:warmup], every[warmup:]
    t_first = reqs[0].arrival_s
    reqs = [replace(r, index=i, arrival_s=r.arrival_s - t_first) for i, r in enumerate(reqs)]
    sizes = {r.value: len(topology.members(r)) for r in (Role.P, Role.RLD, Role.MD)}
    say(
        f"topology {topology_path}: {sizes['p']} P, {sizes['rld']} RLD, {sizes['md']} MD; "
        f"1 router, then {routers} behind haproxy; placement {placement}"
    )
    say(f"workload: {len(reqs)} requests over {reqs[-1].arrival_s:.0f} s after {len(warm)} warm-up requests")
    results: dict[str, list[RequestResult]] = {}
    counters: dict[str, dict[str, dict[str, float]]] = {}
    extras: dict[str, dict[str, Any]] = {}
    wan = LoopbackWan(topology, f"rp{os.getpid() % 100000}")
    try:
        for n in (1, routers):
            name = run_name(n)
            spec = PoolSpec(work / name, topology, placement=placement, routers=n)
            results[name], counters[name], extras[name] = run_routers(spec, wan, warm, reqs, name)
    finally:
        wan.down()
    say("reference: one engine generating every request alone (separate process, float64)")
    from harness.cluster import ClusterSpec

    reference = reference_tokens(reqs, ClusterSpec(work), work)
    runs = {n: {**figures(topology, rs, counters[n], reference), **extras[n]} for n, rs in results.items()}
    doc: dict[str, Any] = {
        "topology": topology_path,
        "routers": routers,
        "placement": placement,
        "runs": runs,
        "setting": {
            "requests": requests,
            "warmup": warmup,
            "rate_rps": rate_rps,
            "seed": seed,
            "lab_mode": "loopback",
            "load_balancer": "haproxy",
            "work_dir": str(work),
        },
    }
    print(table(doc))
    say(f"logs: {work}")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    sys.stdout.flush()
    return doc
