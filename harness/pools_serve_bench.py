"""``pddlink bench vllm-serve --topology F``: vLLM's own benchmark client, unchanged, as the load on
the router over a topology's pools (issue 26, item 7), once per placement policy.

Each policy runs on a fresh deployment (``harness.pool_cluster``: one reference-engine sidecar per
instance, mutual TLS, every WAN link a netlab loopback relay of its rate and RTT, one router whose
``[api]`` has the tiny model's tokenizer and an API key) and takes the same requests:
``vllm bench serve --backend openai`` (in-process, ``vllm.benchmarks.serve``), dataset
``prefix_repetition`` with one seed (shared prefixes, shuffled: what a prefix-aware placement is
for), Poisson arrivals at ``--request-rate`` under ``--max-concurrency``, ``--ignore-eos``. The
routers hold RLD to the pools demo's token budget (``POOLS_RLD_TOKEN_BUDGET``), as
``pddlink demo --topology`` does.

Per policy: the client's completed/failed counts and TTFT/TPOT/ITL percentiles (ms), and what the
pools did with the load: KV bytes each WAN link carried and each MD's DRC hit (blocks found over
blocks looked up, from the MD sidecars' own counters), the router's requests by pipeline. Ratios
are against round robin's run (``ratio_to_round_robin``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cluster import datacenter_cpus
from harness.demo import say
from harness.demo_pools import NAMES, LoopbackWan, md_counters
from harness.pool_cluster import PoolCluster, PoolSpec
from harness.vllm_serve_bench import (
    BACKENDS,
    METRICS,
    PERCENTILES,
    SERVE_KEYS,
    SERVED,
    _pipelines,
    figures,
    ratios,
)
from pddlink.roles import Role
from pddlink.sim.demo_scale import POOLS_RLD_TOKEN_BUDGET
from pddlink.topology import Topology

POLICIES = ("prefix_aware", "round_robin", "prefix_hash")


@dataclass(frozen=True, slots=True)
class PoolsBenchSpec:
    prompts: int = 96
    prefix_len: int = 1024  # tokens every prompt of a group shares
    suffix_len: int = 64  # tokens of its own
    prefixes: int = 12  # groups (prompts per group: prompts // prefixes)
    output_len: int = 32
    request_rate: float = 2.0  # requests/s (Poisson)
    concurrency: int = 16
    seed: int = 26
    backend: str = "openai"
    policies: tuple[str, ...] = POLICIES


def bench_args(spec: PoolsBenchSpec, base_url: str, tokenizer: Path) -> list[str]:
    """``vllm bench serve``'s command line for one run (every policy gets the same one)."""
    return [
        "--backend", spec.backend, "--base-url", base_url, "--endpoint", BACKENDS[spec.backend],
        "--model", SERVED, "--tokenizer", str(tokenizer), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(spec.prefix_len),
        "--prefix-repetition-suffix-len", str(spec.suffix_len),
        "--prefix-repetition-num-prefixes", str(spec.prefixes),
        "--prefix-repetition-output-len", str(spec.output_len),
        "--num-prompts", str(spec.prompts), "--request-rate", str(spec.request_rate),
        "--max-concurrency", str(spec.concurrency), "--seed", str(spec.seed), "--ignore-eos",
        "--disable-tqdm", "--percentile-metrics", ",".join(METRICS),
        "--metric-percentiles", ",".join(map(str, PERCENTILES)),
    ]  # fmt: skip


def run_client(args: list[str], key: str) -> dict[str, Any]:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
    serve.add_cli_args(parser)
    os.environ["OPENAI_API_KEY"] = key  # vLLM's client sends it as a bearer key
    return dict(serve.main(parser.parse_args(args)))


def pools_figures(topo: Topology, counters: dict[str, dict[str, float]]) -> dict[str, Any]:
    """WAN bytes per link and the DRC hit per MD (and over all MDs) from the MD sidecars' counters."""
    p_dc = topo.members(Role.P)[0].datacenter
    dc_of = {m.name: m.datacenter for m in topo.members(Role.MD)}
    by_link: dict[str, int] = {}
    for md, c in counters.items():
        link = f"{p_dc}->{dc_of[md]}"
        by_link[link] = by_link.get(link, 0) + int(c.get("wan_bytes", 0.0))
    hit = sum(c.get("hit_blocks", 0.0) for c in counters.values())
    looked = sum(c.get("lookup_blocks", 0.0) for c in counters.values())
    return {
        "wan_bytes": sum(by_link.values()),
        "wan_bytes_by_link": dict(sorted(by_link.items())),
        "md_hit_rate": round(hit / looked, 4) if looked else 0.0,
        "md_hit_rate_by_instance": {
            md: round(c["hit_blocks"] / c["lookup_blocks"], 4) if c.get("lookup_blocks") else None
            for md, c in sorted(counters.items())
        },
        "md_lookups_by_instance": {md: int(c.get("lookup_blocks", 0)) for md, c in sorted(counters.items())},
    }


def run_policy(
    spec: PoolsBenchSpec, pool: PoolSpec, wan: LoopbackWan, tokenizer: Path, key: str
) -> dict[str, Any]:
    t0 = time.monotonic()
    with PoolCluster(pool, wan) as pools:
        up = time.monotonic() - t0
        say(f"[{pool.placement}] {len(pools.members)} sidecars and the router up in {up:.1f} s")
        before = md_counters(pools)
        t1 = time.monotonic()
        out = figures(run_client(bench_args(spec, pools.router_url(), tokenizer), key))
        out["seconds"] = round(time.monotonic() - t1, 1)
        time.sleep(1.0)  # shipments that outlive their request land on MD
        after = md_counters(pools)
        out["router_pipelines"] = _pipelines(pools.router_url(), key)
    delta = {md: {k: v - before.get(md, {}).get(k, 0.0) for k, v in got.items()} for md, got in after.items()}
    out.update(pools_figures(pool.topology, delta))
    say(f"[{pool.placement}] {out['completed']} completed, {out['failed']} failed in {out['seconds']} s")
    return out


def run(spec: PoolsBenchSpec, topology: Topology, topology_path: str) -> dict[str, Any]:
    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="pddlink-pb-"))
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype="float32"))  # its tokenizer serves the text
    key = secrets.token_urlsafe(24)  # the router's one client key ([api] api_keys_file)
    keys = root / "api_keys"
    keys.write_text(key + "\n")
    keys.chmod(0o600)
    api = (f'model = "{SERVED}"', f'tokenizer = "{model}"', f'api_keys_file = "{keys}"')
    runs: dict[str, Any] = {}
    wan = LoopbackWan(topology, f"pb{os.getpid() % 100000}")
    try:
        for policy in spec.policies:
            pool = PoolSpec(
                root / policy, topology, placement=policy, cpus=datacenter_cpus(), api=api,
                rld_token_budget=POOLS_RLD_TOKEN_BUDGET,
            )  # fmt: skip
            runs[NAMES.get(policy, policy)] = run_policy(spec, pool, wan, model, key)
    finally:
        wan.down()
        shutil.rmtree(root / "model", ignore_errors=True)
    base = runs.get("round_robin")
    for name, row in runs.items():
        if base is not None and name != "round_robin":
            row["ratio_to_round_robin"] = ratios(row, base, (*SERVE_KEYS, "wan_bytes"), 3)
    return {
        "topology": topology_path,
        "client": "vllm bench serve (vllm.benchmarks.serve, in-process), dataset prefix_repetition",
        "setting": {
            "backend": spec.backend,
            "prompts": spec.prompts,
            "prefix_len": spec.prefix_len,
            "suffix_len": spec.suffix_len,
            "prefixes": spec.prefixes,
            "output_len": spec.output_len,
            "request_rate": spec.request_rate,
            "max_concurrency": spec.concurrency,
            "seed": spec.seed,
            "work_dir": str(root),
        },
        "policies": runs,
        "errors": sum(r["failed"] for r in runs.values()),
    }


def table(out: dict[str, Any]) -> str:
    head = f"{'policy':>12}  ok/fail  " + "  ".join(
        f"{m.upper()} p{p:<2}" for m in METRICS for p in PERCENTILES
    )
    lines = [head + "   WAN MB  MD hit"]
    for name, r in out["policies"].items():
        cells = "  ".join(f"{r[f'p{p}_{m}_ms']:>8.1f}" for m in METRICS for p in PERCENTILES)
        lines.append(
            f"{name:>12}  {r['completed']:>3}/{r['failed']:<3}  {cells}  {r['wan_bytes'] / 1e6:>7.1f}  "
            f"{r['md_hit_rate']:>6.1%}"
        )
        lines.append(
            f"{'':>14}per link: "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["wan_bytes_by_link"].items())
        )
        lines.append(
            f"{'':>14}per MD (DRC hit, blocks looked up): "
            + ", ".join(
                f"{md} {'-' if h is None else f'{h:.0%}'} ({r['md_lookups_by_instance'][md]})"
                for md, h in r["md_hit_rate_by_instance"].items()
            )
        )
        if "ratio_to_round_robin" in r:
            q = r["ratio_to_round_robin"]
            lines.append(
                f"{'':>14}vs round robin: TTFT p50 {q['p50_ttft_ms']}x, p90 {q['p90_ttft_ms']}x, "
                f"TPOT p50 {q['p50_tpot_ms']}x, WAN bytes {q['wan_bytes']}x"
            )
    return "\n".join(lines)
