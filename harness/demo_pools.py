"""``pddlink demo --topology F``: the reference engine at pool scale, one router over a topology's
P, RLD and MD pools (``harness.pool_cluster``), replaying the agentic workload once per placement
policy: the same requests each run, each run on a fresh deployment (cold caches, then the same
warm-up through the policy being measured, as ``pddlink sim --topology`` assumes).

Every WAN link is a netlab loopback relay of its own (``LoopbackWan``: the link's rate and RTT;
every byte and call from P, RLD and the router to an MD in that datacenter crosses it). Figures
per policy: TTFT P50/P90/P99, the MD hit rate (mean share of each prompt its MD held, from P's
reservation answers) overall and per instance, requests per instance, WAN bytes per link (what
each MD received, from its own counters), the RLD token share, failures and token mismatches
(every finished request against one engine generating alone). Beside them: ``pddlink sim
--topology``'s prediction of the same runs and the simulator's oracle hit rate.

Policy names in the output: ``placement`` (prefix_aware: per-instance mirrors), ``round_robin``,
``prefix_hash`` (and ``least_loaded`` when asked).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from harness.cluster import datacenter_cpus
from harness.demo import reference_tokens, say
from harness.demo_load import RequestResult, replay
from harness.demo_workload import DemoRequest, build_trace, demo_requests
from harness.pool_cluster import PoolCluster, PoolSpec
from netlab.lab import Lab
from netlab.profile import parse_profile
from pddlink.roles import Role
from pddlink.routing import PlacementPolicy
from pddlink.serving.http import fetch
from pddlink.sim.demo_scale import POOLS_RLD_TOKEN_BUDGET, DemoKnobs
from pddlink.topology import Topology

VOCAB = 2048
NAMES = {"prefix_aware": "placement"}  # what the figures call each policy
DEFAULT_POLICIES = ("prefix_aware", "round_robin", "prefix_hash")


class LoopbackWan:
    """One netlab loopback lab per WAN link of ``topology`` from P's datacenter: an MD
    datacenter's ports are reached through its own link's relay."""

    def __init__(self, topology: Topology, tag: str) -> None:
        p_dc = topology.members(Role.P)[0].datacenter
        self.labs: dict[str, Lab] = {}
        try:
            for k, link in enumerate(topology.links):
                far = link.b if link.a == p_dc else link.a
                profile = (
                    f'description = "{p_dc} <-> {far}"\n'
                    f"[link]\ndelay_ms = {link.rtt_ms / 2}\nrate_mbit = {link.line_mbit}\n"
                    "queue_packets = 200\n"
                )
                self.labs[far] = Lab.up(
                    parse_profile(profile, name=f"pools-{far}"), name=f"{tag}l{k}", mode="loopback"
                )
        except BaseException:
            self.down()
            raise

    def endpoint(self, datacenter: str, port: int) -> tuple[str, int]:
        lab = self.labs.get(datacenter)
        return ("127.0.0.1", port) if lab is None else lab.endpoint("dc-b", port)

    def down(self) -> None:
        for lab in self.labs.values():
            lab.down()


def md_counters(pools: PoolCluster) -> dict[str, dict[str, float]]:
    """Per MD instance: KV bytes received over the WAN and its DRC's lookups and hits (blocks)."""
    out: dict[str, dict[str, float]] = {}
    for name, m in pools.members.items():
        if m.role is not Role.MD or pools.procs.get(name) is None:
            continue
        code, text = fetch("unix:" + pools.admin_socket(name), "GET", "/metrics")
        got: dict[str, float] = {}
        if code == 200:
            for fam in text_string_to_metric_families(text.decode()):
                for s in fam.samples:
                    if s.name == "pddlink_kv_bytes_total" and s.labels.get("path") == "wan":
                        got["wan_bytes"] = s.value
                    elif s.name in ("pddlink_drc_hit_blocks_total", "pddlink_drc_lookup_blocks_total"):
                        got[s.name[len("pddlink_drc_") : -len("_total")]] = s.value
        out[name] = got
    return out


def run_policy(
    spec: PoolSpec, wan: LoopbackWan, warm: list[DemoRequest], reqs: list[DemoRequest], label: str
) -> tuple[list[RequestResult], dict[str, dict[str, float]]]:
    t0 = time.monotonic()
    with PoolCluster(spec, wan) as pools:
        say(f"[{label}] {len(pools.members)} sidecars and the router up in {time.monotonic() - t0:.1f} s")
        if warm:
            pace = DemoKnobs().warmup_pace_s  # what the simulator assumes too
            paced = [replace(r, arrival_s=pace * i) for i, r in enumerate(warm)]
            w = asyncio.run(
                replay(pools.router_target, paced, deadline_s=spec.deadline_s, pipeline="p_md", id_prefix="w")
            )
            say(
                f"[{label}] warm-up: {len(w)} requests P->MD "
                f"({sum(r.outcome != 'finished' for r in w)} failed)"
            )
        before = md_counters(pools)
        t1 = time.monotonic()
        results = asyncio.run(replay(pools.router_target, reqs, deadline_s=spec.deadline_s))
        say(f"[{label}] {len(results)} requests in {time.monotonic() - t1:.1f} s")
        time.sleep(1.0)  # shipments that outlive their request land on MD
        after = md_counters(pools)
        with open(spec.run_dir / "requests.jsonl", "w") as f:
            for r in results:
                f.write(
                    json.dumps({"index": r.index, "ttft_s": r.ttft_s, "outcome": r.outcome, "trace": r.trace})
                    + "\n"
                )
    delta = {md: {k: v - before.get(md, {}).get(k, 0.0) for k, v in got.items()} for md, got in after.items()}
    return results, delta


def pct(xs: list[float]) -> dict[str, float]:
    """P50, P90, P99 of ``xs`` (0 when empty), rounded to 0.1 ms."""
    if not xs:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.array(xs)
    return {f"p{q}": round(float(np.percentile(a, q)), 4) for q in (50, 90, 99)}


def figures(
    topo: Topology,
    results: list[RequestResult],
    counters: dict[str, dict[str, float]],
    reference: list[list[int]],
) -> dict[str, Any]:
    p_dc = topo.members(Role.P)[0].datacenter
    dc_of = {m.name: m.datacenter for m in topo.members(Role.MD)}
    ok = [r for r in results if r.outcome == "finished"]
    ttft = [r.ttft_s if r.ttft_s is not None else r.e2e_s for r in results]
    hits: dict[str, list[float]] = defaultdict(list)
    every: list[float] = []
    for r in results:
        t = r.trace
        md = (t.get("placement") or {}).get("md")
        if md is None or not t.get("prompt_tokens"):
            continue
        held = t.get("md_cached_tokens", t.get("mirror_matched_tokens", 0))
        share = min(1.0, held / t["prompt_tokens"])
        hits[md].append(share)
        every.append(share)
    wan_by_link: dict[str, float] = defaultdict(float)
    for md, c in counters.items():
        wan_by_link[f"{p_dc}->{dc_of[md]}"] += c.get("wan_bytes", 0.0)
    tokens = {"rld": 0, "md": 0}
    for r in ok:
        for src, n in r.sources.items():
            tokens[src] = tokens.get(src, 0) + n
    produced = sum(tokens.values())
    return {
        "requests": len(results),
        "ttft_s": pct(ttft),
        "md_hit_rate": round(float(np.mean(every)), 4) if every else 0.0,
        "md_hit_rate_by_instance": {md: round(float(np.mean(h)), 4) for md, h in sorted(hits.items())},
        "md_requests_by_instance": {md: len(h) for md, h in sorted(hits.items())},
        "drc_hit_rate_by_instance": {
            md: round(c.get("hit_blocks", 0.0) / c["lookup_blocks"], 4) if c.get("lookup_blocks") else None
            for md, c in sorted(counters.items())
        },
        "wan_bytes": int(sum(wan_by_link.values())),
        "wan_bytes_by_link": {k: int(v) for k, v in sorted(wan_by_link.items())},
        "rld_token_share": round(tokens.get("rld", 0) / produced, 4) if produced else 0.0,
        "failed": sum(r.outcome != "finished" for r in results),
        "failure_reasons": sorted({r.reason for r in results if r.outcome != "finished"})[:5],
        "token_mismatches": sum(1 for r in ok if r.tokens != reference[r.index]),
    }


def simulate(topo: Topology, workload: str | None, requests: int, warmup: int, rate_rps: float, seed: int,
             policies: list[str], budget: float = POOLS_RLD_TOKEN_BUDGET) -> dict[str, Any]:  # fmt: skip
    from harness.demo_workload import _workload_path
    from pddlink.sim.pools import run_topology
    from pddlink.sim.workload import load_workload

    knobs = DemoKnobs(requests=requests, warmup=warmup, rate_rps=rate_rps, seed=seed, rld_token_budget=budget)
    wl = load_workload(_workload_path(workload))
    return run_topology(topo, wl, knobs, [PlacementPolicy(p) for p in policies], per_request=True)


def measured_rows(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Each request as ``pddlink.sim.pools.request_rows`` writes the simulator's: its MD, option,
    the prompt's tokens MD held (``figures``' definition) and TTFT."""
    rows = []
    for r in results:
        t = r.trace
        prompt = t.get("prompt_tokens") or 0
        rows.append(
            {
                "index": r.index,
                "md": (t.get("placement") or {}).get("md"),
                "option": t.get("option"),
                "prompt_tokens": prompt,
                "md_cached_tokens": t.get("md_cached_tokens", t.get("mirror_matched_tokens", 0)),
                "ttft_s": r.ttft_s,
            }
        )
    return rows


def sim_side_by_side(
    sim: dict[str, Any], results: dict[str, list[RequestResult]], work: Path
) -> dict[str, Any]:
    """Each policy's simulated requests beside the measured ones: written next to the demo's
    ``requests.jsonl`` (``sim_requests.jsonl``) and summed up (``pddlink.sim.pools.agreement``)."""
    from pddlink.sim.pools import agreement

    out: dict[str, Any] = {}
    for policy, f in sim["policies"].items():
        rows = f.pop("per_request", [])
        name = NAMES.get(policy, policy)
        if name not in results:
            continue
        with open(work / name / "sim_requests.jsonl", "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
        out[name] = agreement(measured_rows(results[name]), rows)
    return out


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'policy':>12}  {'TTFT p50':>8} {'p90':>7} {'p99':>7}  {'MD hit':>6}  {'WAN MB':>7}  "
             f"{'RLD share':>9}  {'failed':>6}  {'mism.':>5}  sim p90  sim hit"]  # fmt: skip
    for name, f in doc["policies"].items():
        t, s = f["ttft_s"], doc["sim"].get(name, {})
        lines.append(
            f"{name:>12}  {t['p50']:>8.3f} {t['p90']:>7.3f} {t['p99']:>7.3f}  {f['md_hit_rate']:>6.1%}  "
            f"{f['wan_bytes'] / 1e6:>7.1f}  {f['rld_token_share']:>9.1%}  {f['failed']:>6}  "
            f"{f['token_mismatches']:>5}  {s.get('ttft_s', {}).get('p90', float('nan')):>7.3f}  "
            f"{s.get('md_hit_rate', float('nan')):>6.1%}"
        )
        lines.append(
            f"{'':>14}per link: "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in f["wan_bytes_by_link"].items())
        )
        per_md = f["md_hit_rate_by_instance"].items()
        n_md = f["md_requests_by_instance"]
        lines.append(
            f"{'':>14}per MD (hit, requests): " + ", ".join(f"{md} {h:.0%} ({n_md[md]})" for md, h in per_md)
        )
    for name, a in doc.get("sim_agreement", {}).items():
        if a["requests"]:
            lines.append(
                f"{name:>12}  against the simulator, request by request: same MD {a['same_md']:.0%}, "
                f"same option {a['same_option']:.0%}, MD hit off by {a['hit_abs_diff']:.1%} on average"
            )
    lines.append(f"oracle MD hit rate (simulator): {doc['oracle_md_hit_rate']:.1%}")
    return "\n".join(lines)


def plot(per_policy: dict[str, list[float]], path: Path, title: str = "pddlink demo --topology") -> None:
    """Each policy's TTFT distribution (a CDF per policy), as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, xs in per_policy.items():
        a = np.sort(np.array(xs))
        ax.plot(a, np.arange(1, len(a) + 1) / max(1, len(a)), label=name)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{title}: TTFT per placement policy")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(
    *,
    topology: Topology,
    topology_path: str,
    requests: int,
    rate_rps: float,
    workload: str | None,
    json_path: str | None,
    plot_path: str,
    seed: int,
    warmup: int,
    policies: list[str] | None = None,
    rld_token_budget: float = POOLS_RLD_TOKEN_BUDGET,
) -> dict[str, Any]:
    policies = list(policies or DEFAULT_POLICIES)
    work = Path(tempfile.mkdtemp(prefix="pddlink-pools-"))
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
    links = ", ".join(f"{k.a}-{k.b} {k.line_mbit:g} Mbit/s {k.rtt_ms:g} ms" for k in topology.links)
    say(f"topology {topology_path}: {sizes['p']} P, {sizes['rld']} RLD, {sizes['md']} MD; links {links}")
    say(f"RLD token budget {rld_token_budget:g}: no new relay while RLD made that share of the recent tokens")
    say(f"workload: {len(reqs)} requests over {reqs[-1].arrival_s:.0f} s after {len(warm)} warm-up requests")
    results: dict[str, list[RequestResult]] = {}
    counters: dict[str, dict[str, dict[str, float]]] = {}
    tag = f"pl{os.getpid() % 100000}"
    wan = LoopbackWan(topology, tag)
    try:
        for policy in policies:
            name = NAMES.get(policy, policy)
            cpus = datacenter_cpus()
            spec = PoolSpec(
                work / name, topology, placement=policy, cpus=cpus, rld_token_budget=rld_token_budget
            )
            results[name], counters[name] = run_policy(spec, wan, warm, reqs, name)
    finally:
        wan.down()
    say("reference: one engine generating every request alone (separate process, float64)")
    from harness.cluster import ClusterSpec

    reference = reference_tokens(reqs, ClusterSpec(work), work)
    sim = simulate(topology, workload, requests, warmup, rate_rps, seed, policies, rld_token_budget)
    side_by_side = sim_side_by_side(sim, results, work)
    doc: dict[str, Any] = {
        "topology": topology_path,
        "policies": {n: figures(topology, rs, counters[n], reference) for n, rs in results.items()},
        "oracle_md_hit_rate": sim["oracle_md_hit_rate"],
        "sim": {NAMES.get(p, p): f for p, f in sim["policies"].items() if p in policies},
        "sim_agreement": side_by_side,
        "setting": {
            "requests": requests,
            "warmup": warmup,
            "rate_rps": rate_rps,
            "seed": seed,
            "rld_token_budget": rld_token_budget,
            "lab_mode": "loopback",
            "work_dir": str(work),
        },
    }
    print(table(doc))
    ttfts = {n: [r.ttft_s if r.ttft_s is not None else r.e2e_s for r in rs] for n, rs in results.items()}
    plot(ttfts, Path(plot_path))
    say(f"TTFT distributions: {plot_path}; logs: {work}")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    sys.stdout.flush()
    return doc
