"""The demo's scaled-down deployment, so ``pddlink sim --scenario demo`` can be set beside ``pddlink demo``.

``pddlink demo`` runs one P, one RLD and one MD with the CPU reference engine across a netlab line
(default 16 Mbit/s, 20 ms RTT, 2048 KV bytes per token), replaying the agentic workload scaled to
16-token blocks and ~768-token contexts, outputs divided by 4 (at least 8, at most 512; singular
bounds divided too: ``single_demo_knobs``; the pools demo and the wan-overload scenario divide by 8,
at most 128). This module builds the same traffic and a deployment with CPU-engine speeds.
Prefill speed is fitted to a demo run's per-request records (``prefill_seconds`` against the new
tokens: ~17 ms + 1/3300 s per token on this machine); decode speeds are estimates for the tiny
float64 reference model that land near the demo's measured TPOT (P50 10-14 ms). The demo's
warm-up requests (the first ``warmup``) only fill the caches, as ``pddlink demo --warmup`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pddlink.routing import RoutingPolicy
from pddlink.sim.deploy import Deployment, Kind, Link, Pool
from pddlink.sim.generate import GeneratorConfig, generate_trace
from pddlink.sim.hardware import GPU_A, AFigures
from pddlink.sim.trace import Trace, TraceRequest, read_trace, scale_trace
from pddlink.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class DemoKnobs:
    requests: int = 200
    warmup: int = 16  # requests replayed first to warm the caches (``pddlink demo --warmup``)
    warmup_pace_s: float = 0.4  # ``pddlink demo --topology`` sends its warm-up this far apart
    rate_rps: float = 4.0
    seed: int = 1  # ``pddlink demo --seed``
    line_mbit: float = 16.0
    rtt_s: float = 0.02
    kv_bytes_per_token: int = 2048
    engine_blocks: int = 4096  # every engine's KV pool, in blocks (``harness.pool_cluster``: P's and MD's)
    wan_links: int = 2  # P's WAN connections toward each MD (``harness.pool_cluster``; the router's too)
    prefill_tokens_per_s: float = 3300.0  # measured: pddlink demo's per-request prefill_seconds
    prefill_fixed_s: float = 0.017  # measured: the same fit's intercept (one batch's fixed cost)
    decode_step_s: float = 0.006
    decode_seq_s: float = 0.002
    rld_seqs: int = 6
    md_seqs: int = 32
    block_tokens: int = 16
    context_tokens: int = 768
    output_divisor: int = 8
    max_output: int = 128
    # the demo pins MD to CPUs of its own and runs P, RLD and the router on the others
    # (``harness.cluster.datacenter_cpus``): RLD decodes on P's chips
    rld_shares_p_chips: bool = True
    # RLD's share of the recent output tokens at which no new relay starts (``RoutingPolicy``; 1:
    # none). The pools (``pddlink demo --topology``) run with ``POOLS_RLD_TOKEN_BUDGET``.
    rld_token_budget: float = 1.0


# The pools demo's RLD budget: RelayDecode is a small tier that hides the few low-hit requests
# (DESIGN: the published fleet runs 3 RLD GPUs beside 32 MD). The workload's prompts below 0.7
# hit are 12% of the requests; a relay's tokens are those RLD makes before its handoff, at the
# pools' short outputs most of them (45 relays of 200 made 21% of the tokens under prefix-aware
# placement, 2026-12-05). A quarter of the tokens leaves RLD that and a margin, and no more: without
# a budget, a placement that misses the caches relays its way out of every miss on a tier sized
# for a few (round robin: 134 relays of 200, 60% of the tokens on the example's 2 RLD).
POOLS_RLD_TOKEN_BUDGET = 0.25


def single_demo_knobs(seed: int = 1) -> DemoKnobs:
    """The default demo's knobs (one P, RLD and MD: ``pddlink demo`` and ``pddlink sim --scenario
    demo``): outputs divided by 4, at most 512 tokens. With the pools' 8 and 128, the tiny engine's
    RLD (about 4 ms a token) finished 44 of 46 relayed requests before their KV crossed the 16 Mbit/s
    line, so a run saw 0 to 2 handoffs: the outputs were short next to the WAN time, where the
    deployment's are long next to theirs."""
    return DemoKnobs(seed=seed, output_divisor=4, max_output=512)


def demo_trace(workload: Workload, k: DemoKnobs) -> Trace:
    cfg = GeneratorConfig(
        rate_rps=k.rate_rps, requests=k.requests + k.warmup, seed=k.seed, block_tokens=k.block_tokens,
        context_tokens=k.context_tokens, turn_gap_s=(2.0, 8.0),
    )  # fmt: skip
    trace = generate_trace(workload, cfg)

    def shrink(r: TraceRequest) -> TraceRequest:
        n = demo_output_tokens(r, k)
        return replace(r, output_tokens=n, max_tokens=n)

    return Trace(trace.meta, tuple(shrink(r) for r in trace.requests))


def replay_trace(
    *,
    requests: int,
    rate_rps: float,
    seed: int,
    workload: Workload,
    trace_file: str | Path | None,
    k: DemoKnobs = DemoKnobs(),
) -> Trace:
    """What ``pddlink demo`` replays: ``trace_file``'s first ``requests`` (scaled to ~``context_tokens``
    prompts, arrivals stretched to ``rate_rps`` on average), else agentic traffic generated at the
    demo's scale."""
    if trace_file:
        raw = read_trace(trace_file)
        first = raw.requests[0].arrival_s if raw.requests else 0.0
        span = max((raw.requests[min(requests, len(raw.requests)) - 1].arrival_s - first), 1e-9)
        time_scale = (requests / rate_rps) / span
        return scale_trace(raw, context_tokens=k.context_tokens, time_scale=time_scale, limit=requests)
    cfg = GeneratorConfig(
        rate_rps=rate_rps, requests=requests, seed=seed, block_tokens=k.block_tokens,
        context_tokens=k.context_tokens, turn_gap_s=(2.0, 8.0),
    )  # fmt: skip
    return generate_trace(workload, cfg)


def demo_output_tokens(r: TraceRequest, k: DemoKnobs) -> int:
    """The output length the demo asks for: the trace's divided by ``output_divisor``, at least 8
    (singular bounds, at most 16 tokens: divided too, at least 1), at most ``max_output``."""
    if r.max_tokens <= 16:
        return min(k.max_output, max(1, round(r.max_tokens / k.output_divisor)))
    return min(k.max_output, max(8, round(r.output_tokens / k.output_divisor)))


def demo_policy() -> RoutingPolicy:
    """The demo router's policy: ``pddlink router``'s defaults as ``harness.cluster`` starts it
    (relay from a 0.15 s WAN estimate, no RLD load ceiling, singular only up to 4 output tokens)."""
    return RoutingPolicy(relay_min_wan_s=0.15, rld_max_load=1.0, singular_max_output_tokens=4)


def pools_schedule(trace: Trace, k: DemoKnobs) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """What ``pddlink demo --topology`` sends, in two phases: the first ``warmup`` requests
    ``warmup_pace_s`` apart (forced P->MD, all finished before the next phase), then the others
    with their arrivals counted from the first of them."""
    warm = [replace(r, arrival_s=i * k.warmup_pace_s) for i, r in enumerate(trace.requests[: k.warmup])]
    rest = trace.requests[k.warmup :]
    t0 = rest[0].arrival_s if rest else 0.0
    return warm, [replace(r, arrival_s=r.arrival_s - t0) for r in rest]


def measured_from_s(trace: Trace, k: DemoKnobs) -> float:
    """Arrival of the first measured request: those before it only warm the caches."""
    return trace.requests[min(k.warmup, len(trace.requests) - 1)].arrival_s if k.warmup else 0.0


def demo_deployments(k: DemoKnobs) -> list[Deployment]:
    fig = AFigures(
        prefill_tok_s=1.0 / k.prefill_tokens_per_s, prefill_attn_s=0.0, prefill_batch_s=k.prefill_fixed_s,
        prefill_batch_tokens=2048, decode_step_s=k.decode_step_s, decode_seq_s=k.decode_seq_s,
        decode_kv_token_s=0.0, kv_capacity_tokens_per_gpu=10**7, max_seqs_per_gpu=k.md_seqs,
        extend_base_s=0.01, extend_token_s=k.decode_seq_s,
    )  # fmt: skip
    link = Link(wan_gbps=k.line_mbit / 1000, wan_efficiency=0.95, rtt_s=k.rtt_s, pool_size=4,
                flow_cap_gbps=k.line_mbit / 1000, fast_gbps=10.0, fast_setup_s=0.002)  # fmt: skip
    common = dict(fig=fig, link=link, kv_bytes_per_token=k.kv_bytes_per_token, drc_tokens_per_gpu=10**7)
    one = Pool(GPU_A, 1, 1)
    cross = Deployment("cross_dc_pd", Kind.CROSS_DC_PD, one, one, **common)  # type: ignore[arg-type]
    pdd = Deployment(
        "pdd", Kind.PDD, one, one, Pool(GPU_A, 1, 1), policy=demo_policy(),
        relay_fig=replace(fig, max_seqs_per_gpu=k.rld_seqs), rld_shares_p_chips=k.rld_shares_p_chips,
        **common,  # type: ignore[arg-type]
    )  # fmt: skip
    return [cross, pdd]
