"""``pddlink demo --engine vllm --topology F``: the pools demo on vLLM servers (issue 26, item 6).

Every instance of F (its shape: datacenters, pools, names, links; its addresses are replaced) runs
as a vLLM server (the tiny random float32 Llama) beside its pddlink vLLM sidecar
(``harness.vllm.pool.VllmPool``); every WAN link is a netlab loopback relay at that link's rate and
RTT (``harness.demo_pools.LoopbackWan``), which P's KV and the router's calls to an MD in that
datacenter cross; RLD is beside P. The router (in this process, ``engine = "vllm"`` over the
topology) places each request (P, MD and, when relayed, RLD) by the policy under test; each MD's
mirror follows that MD's own KV-cache events.

The load is ``pddlink demo --engine vllm``'s agentic sessions (``harness.vllm_demo``: a shared
system prompt, every turn re-sending the conversation, two sessions at a time), the same requests
under every policy, each policy on a fresh deployment. Every answer is checked against P's vLLM
generating alone. Figures per policy: TTFT P50/P90/P99, requests per MD, KV bytes per WAN link (P's
sidecars' per-instance counts), the MD hit (each MD's share of the prompts' whole blocks its own
DRC held when P shipped: P's transfer records), the RLD token share, handoffs, failures, token
mismatches, and what the sidecars still hold afterwards (all 0 when nothing leaked). Ratios are
against round robin.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.demo_pools import NAMES, LoopbackWan, pct, plot
from harness.vllm.pool import PoolSpec, VllmPool
from harness.vllm_demo import VllmDemoSpec, _replay, say
from pddlink.roles import Role
from pddlink.topology import Topology

POLICIES = ("prefix_aware", "round_robin", "prefix_hash")


@dataclass(frozen=True, slots=True)
class VllmPoolsDemoSpec:
    demo: VllmDemoSpec  # the sessions (and the servers' dtype, deadline, extra arguments)
    policies: tuple[str, ...] = POLICIES
    rld_capacity: int = 3


def router_config(pool: VllmPool, model: str, spec: VllmPoolsDemoSpec, policy: str) -> Any:
    """The router over the pool's topology: the knobs of ``harness.vllm_demo.router_config``."""
    from router import RouterConfig, VllmEngineConfig

    topo = pool.topology
    d = spec.demo
    return RouterConfig(
        engine="vllm",
        topology=topo,
        placement=policy,
        vllm=VllmEngineConfig(model=model, rld_gets_kv=bool(topo.members(Role.RLD))),
        vocab_size=1024,
        deadline_s=d.deadline_s,
        relay_enabled=bool(topo.members(Role.RLD)),
        kv_bytes_per_token=2048 if d.dtype == "float32" else 1024,
        rld_capacity=spec.rld_capacity,
        singular_max_tokens=1,
        recompute=False,
    )


def _settled(pool: VllmPool, limit_s: float = 20.0) -> dict[str, Any]:
    """Every sidecar's status once P has nothing in flight (a relayed turn's KV still crossing to
    MD for the next turn ends within its deadline), or at ``limit_s``."""
    end = time.monotonic() + limit_s
    while True:
        status = pool.status()
        busy = sum(int(status[n].get("in_flight", 0)) for n in pool.p_names)
        if not busy or time.monotonic() > end:
            return status
        time.sleep(0.5)


def figures(
    topo: Topology,
    run: dict[str, Any],
    status: dict[str, Any],
    records: dict[str, dict[str, Any]],
    p_names: list[str],
) -> dict[str, Any]:
    """One policy's figures; ``records``: each P's finished transfers (its ``/transfers``)."""
    p_dc = topo.members(Role.P)[0].datacenter
    dc_of = {m.name: m.datacenter for m in topo.members(Role.MD)}
    placed: dict[str, int] = defaultdict(int)
    tokens = {"rld": 0, "md": 0}
    handoffs = {"one_shot": 0, "catch_up": 0}
    for d in run["done"]:
        t = d.trace
        for src, n in t.get("tokens", {}).items():
            tokens[src] = tokens.get(src, 0) + n
        if t.get("handoff_outcome") == "handed_off" and t.get("handoff_mode") in handoffs:
            handoffs[t["handoff_mode"]] += 1
        md = (t.get("placement") or {}).get("md")
        if md:
            placed[md] += 1
    wan: dict[str, int] = defaultdict(int)
    ships: dict[str, dict[str, int]] = {}  # per MD: P's transfers to it that shipped, that failed
    for p in p_names:
        for inst, c in (status[p].get("instances") or {}).items():
            if inst in dc_of:
                wan[f"{p_dc}->{dc_of[inst]}"] += int(c.get("bytes", 0))
                got = ships.setdefault(inst, {"shipped": 0, "failed": 0})
                got["shipped"] += int(c.get("shipped", 0))
                got["failed"] += int(c.get("failed", 0))
    held: dict[str, int] = defaultdict(int)  # per MD: the prompts' whole blocks its DRC held
    blocks: dict[str, int] = defaultdict(int)  # ... of all of them
    for p in p_names:
        for rec in records[p].values():
            leg = (rec.get("legs") or {}).get("md") or {}
            if leg.get("instance") in dc_of and leg.get("num_blocks"):
                held[leg["instance"]] += int(leg.get("first_block", 0))
                blocks[leg["instance"]] += int(leg["num_blocks"])
    produced = sum(tokens.values())
    return {
        "requests": len(run["done"]) + len(run["failed"]),
        "ttft_s": pct(run["ttft"]),
        "md_hit_rate": round(sum(held.values()) / sum(blocks.values()), 4) if blocks else 0.0,
        "md_hit_rate_by_instance": {md: round(held[md] / n, 4) for md, n in sorted(blocks.items())},
        "md_requests_by_instance": dict(sorted(placed.items())),
        "wan_bytes": sum(wan.values()),
        "wan_bytes_by_link": dict(sorted(wan.items())),
        "md_transfers_by_instance": dict(sorted(ships.items())),
        "rld_token_share": round(tokens["rld"] / produced, 4) if produced else 0.0,
        "handoffs": handoffs,
        "failed": len(run["failed"]),
        "failures": run["failed"][:10],
        "token_mismatches": len(run["divergences"]),
        "held": {
            name: {k: s.get(k, 0) for k in ("held_slots", "held_bytes", "in_flight")}
            for name, s in status.items()
        },
    }


def run_policy(spec: VllmPoolsDemoSpec, root: Path, model: Path, shape: Topology, wan: LoopbackWan,
               policy: str) -> dict[str, Any]:  # fmt: skip
    from harness.vllm import SEEDED_SAMPLING
    from harness.vllm_demo import room_args

    d = spec.demo
    pool = VllmPool(
        PoolSpec(
            root / policy, model, topology=shape, wan=wan, dtype=d.dtype, pin_cores=d.pin_cores,
            extra_args=("--logits-processors", SEEDED_SAMPLING, *room_args(), *d.extra_args),
            wan_line_mbit=d.line_mbit,
        )
    )  # fmt: skip
    t0 = time.monotonic()
    pool.start()
    try:
        cores = ", ".join(f"{k} on {list(v)}" for k, v in pool.cores.items()) or "not pinned"
        say(f"[{policy}] {len(pool.servers)} vLLM servers up in {time.monotonic() - t0:.1f} s ({cores})")
        cfg = router_config(pool, str(model), spec, policy)
        run = asyncio.run(_replay(cfg, d, "", pool.p.url, policy))
        status = _settled(pool)
        records = {p: pool.transfers(p)["done"] for p in pool.p_names}
        return figures(pool.topology, run, status, records, pool.p_names) | {"ttft_values": run["ttft"]}
    finally:
        pool.close()


def ratios(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        f"ttft_{q}": round(row["ttft_s"][q] / base["ttft_s"][q], 3) if base["ttft_s"][q] else None
        for q in ("p50", "p90", "p99")
    }
    out["wan_bytes"] = round(row["wan_bytes"] / base["wan_bytes"], 3) if base["wan_bytes"] else None
    return out


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'policy':>12}  {'TTFT p50':>8} {'p90':>7} {'p99':>7}  {'MD hit':>6}  {'WAN MB':>7}  "
             f"{'RLD share':>9}  {'failed':>6}  {'mism.':>5}  handoffs"]  # fmt: skip
    for name, f in doc["policies"].items():
        t, h = f["ttft_s"], f["handoffs"]
        lines.append(
            f"{name:>12}  {t['p50']:>8.3f} {t['p90']:>7.3f} {t['p99']:>7.3f}  {f['md_hit_rate']:>6.1%}  "
            f"{f['wan_bytes'] / 1e6:>7.1f}  {f['rld_token_share']:>9.1%}  {f['failed']:>6}  "
            f"{f['token_mismatches']:>5}  {h['one_shot']} one-shot, {h['catch_up']} catch-up"
        )
        lines.append(
            f"{'':>14}per link: "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in f["wan_bytes_by_link"].items())
        )
        x = f["md_transfers_by_instance"]
        lines.append(
            f"{'':>14}P's transfers per MD (shipped/failed): "
            + ", ".join(f"{md} {c['shipped']}/{c['failed']}" for md, c in x.items())
        )
        n = f["md_requests_by_instance"]
        lines.append(
            f"{'':>14}per MD (hit, requests): "
            + ", ".join(f"{md} {hit:.0%} ({n[md]})" for md, hit in f["md_hit_rate_by_instance"].items())
        )
        if "ratio_to_round_robin" in f:
            q = f["ratio_to_round_robin"]
            lines.append(f"{'':>14}vs round robin: TTFT p90 {q['ttft_p90']}x, WAN bytes {q['wan_bytes']}x")
    return "\n".join(lines)


def run(spec: VllmPoolsDemoSpec, shape: Topology, topology_path: str, json_path: str | None,
        plot_path: Path) -> dict[str, Any]:  # fmt: skip
    import vllm.distributed.kv_events  # noqa: F401  (before the sidecars' loops import it)

    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="pddlink-vpd-"))  # sockets: keep the path short
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype=spec.demo.dtype))
    sizes = {r.value: len(shape.members(r)) for r in (Role.P, Role.RLD, Role.MD)}
    links = ", ".join(f"{k.a}-{k.b} {k.line_mbit:g} Mbit/s {k.rtt_ms:g} ms" for k in shape.links)
    pools = f"{sizes['p']} P, {sizes['rld']} RLD, {sizes['md']} MD vLLM servers"
    say(f"topology {topology_path}: {pools}; {links}")
    policies: dict[str, Any] = {}
    wan = LoopbackWan(shape, f"vp{os.getpid() % 100000}")
    try:
        for policy in spec.policies:
            policies[NAMES.get(policy, policy)] = run_policy(spec, root, model, shape, wan, policy)
    finally:
        wan.down()
        if not os.environ.get("PDDLINK_KEEP_WORKDIR"):
            shutil.rmtree(root, ignore_errors=True)
    values = {name: f.pop("ttft_values") for name, f in policies.items()}
    base = policies.get("round_robin")
    for name, f in policies.items():
        if base is not None and name != "round_robin":
            f["ratio_to_round_robin"] = ratios(f, base)
    d = spec.demo
    doc: dict[str, Any] = {
        "engine": "vllm",
        "topology": topology_path,
        "policies": policies,
        "requests": sum(f["requests"] for f in policies.values()),
        "failed": sum(f["failed"] for f in policies.values()),
        "token_mismatches": sum(f["token_mismatches"] for f in policies.values()),
        "setting": {
            "sessions": d.sessions,
            "turns": d.turns,
            "parallel": d.parallel,
            "max_tokens": d.max_tokens,
            "dtype": d.dtype,
            "model": "tiny random Llama",
            "seed": d.seed,
            "lab_mode": "loopback",
        },
    }
    plot(values, plot_path, "pddlink demo --engine vllm --topology")
    text = json.dumps(doc, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    print(text)
    say(table(doc))
    say(f"TTFT distributions: {plot_path}")
    return doc


def demo_spec(sessions: int, turns: int, seed: int, engine_args: str) -> VllmPoolsDemoSpec:
    base = VllmDemoSpec(sessions=sessions, turns=turns, seed=seed, extra_args=tuple(engine_args.split()))
    return VllmPoolsDemoSpec(replace(base, bf16_sessions=0, pdd=True))
