"""The simulator's prediction for ``pddlink demo --scenario wan-overload``: the same requests, line,
SLO and three policies, so the demo can set its measured ranking beside the simulated one.

The demo replays a trace (agentic-v1 generated, or a ``--trace`` file) scaled to this machine with
the tiny CPU engine, on a line that carries ``1 / load`` of the missing suffixes' KV
(``offered_suffix_bytes_s``: every earlier prompt cached, the least the WAN must carry), three
times: the P->MD baseline (ship only, no admission), ``pdd`` (recompute, admission, the router holds
the SLO: TTFT deadline and the TPOT bound, RelayDecode under its token budget) and ``unbounded``
(recompute and admission without the SLO). ``overload_deployments`` builds those three on
``demo_scale``'s deployment with the router's settings as ``harness.demo`` starts it: admission's
deadline is P's WAN share of the request's (0.6 x 30 s), the reference engine prefills a prompt in
one step (blocking: ``md_chunk_tokens`` larger than any prompt), and decode speeds are the tiny
engine's on a quiet machine (``OVERLOAD_KNOBS``). ``predict`` runs them and ranks them by goodput;
``ranking_agrees`` compares that with a measured ranking. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pddlink.errors import ConfigError
from pddlink.routing.link import WAN_SHARE_OF_DEADLINE
from pddlink.sim.demo_scale import DemoKnobs, demo_deployments, demo_output_tokens
from pddlink.sim.deploy import Deployment, Pool
from pddlink.sim.hardware import HardwareType
from pddlink.sim.records import Sla
from pddlink.sim.scenario import run_deployments
from pddlink.sim.trace import Trace, TraceRequest

POLICIES = ("baseline", "pdd", "unbounded")
BLOCKING = 1 << 30  # a chunk budget no prompt reaches: the reference engine's one-step prefill
# Within this much of each other (requests/s), two goodputs are a tie: the demo's runs of one
# regime differ by more than that between runs on a shared machine
TIE_RPS = 0.05


@dataclass(frozen=True, slots=True)
class OverloadKnobs:
    # The tiny engine as the demo ran it before MD had a CPU of its own: 3.5 ms per step and 1.5 ms
    # per sequence in it. The engine's forward pass alone costs ~0.6 ms more per sequence (``pddlink
    # bench engine --preset tiny --dtype float64``: 4.1 ms at batch 1, 8.6 ms at batch 8), but each
    # token also crosses MD's sidecar, the router and the client, all on the same two cores: the demo
    # of 2026-12-04 measured
    # 178 tok/s per request for the baseline and 127 (goodput 2.77 req/s) for PDD unbounded, where
    # 0.6 ms predicted 238 and 200 (3.83) and 1.5 ms predicts 178 and 118 (2.65). Requests that
    # found 4-5 others on MD decoded at 11-13 ms per token, those alone at 5.4 ms.
    # Since the demo pins MD to a CPU of its own (``harness.cluster.datacenter_cpus``), MD decodes
    # about twice as fast: wan-overload's runs of 2026-12-04 fitted, over requests MD decoded alone
    # of RLD (recompute stalls taken out, ``md_stall_s``), 2.6-3.3 ms per token plus 0.5-0.9 ms per
    # other request in flight: a step of ~2.2 ms and ~0.75 ms per sequence in it. Prefill, fitted
    # to the same runs' traces: MD's recomputes 6,500-6,700 tokens/s (conversation trace) and
    # 9,500-10,300 (agentic), P's prefills 5,700-9,600 with 11-15 ms fixed; 3,300 tokens/s and 17
    # ms (``DemoKnobs``' figures, fitted before) made every recompute's stall twice as long, and the
    # prediction ranked unbounded recompute far below what the demo measured (1.29 against 3.69).
    demo: DemoKnobs = field(
        default_factory=lambda: DemoKnobs(
            decode_step_s=0.0022, decode_seq_s=0.00075, prefill_tokens_per_s=7000.0, prefill_fixed_s=0.012
        )
    )
    deadline_s: float = 30.0  # ``ClusterSpec.deadline_s``; admission uses WAN_SHARE_OF_DEADLINE of it
    rld_token_budget: float = 0.08  # ``harness.demo.RLD_TOKEN_BUDGET``
    max_prompt_tokens: int = 1500  # ``harness.demo_workload.demo_requests``' cut
    vocab_size: int = 2048  # the tiny preset's (``harness.demo.VOCAB``)
    load: float = 2.0  # offered suffix bytes / line rate (``harness.demo_overload.TARGET_LOAD``)
    # MD's chips prefill this many times slower than P's (``pddlink demo --md-prefill-slowdown``: a
    # decode-leaning chip, emulated by MD's engine, ``engine.prefill_slowdown``); 1: the same chips
    md_prefill_slowdown: float = 1.0

    def slowed(self, factor: float) -> OverloadKnobs:
        """The same engine ``factor`` times slower at everything (a machine shared with other
        work: the demo's baseline TPOT P50 ranged 5.1-9.7 ms between runs against ~4.5 ms quiet);
        ``factor`` < 1: faster (the engine since, 1.4-3.3 ms on 2026-12-06)."""
        if factor <= 0:
            raise ConfigError(f"slowed: factor must be > 0, got {factor}")
        d = self.demo
        slow = replace(
            d, decode_step_s=d.decode_step_s * factor, decode_seq_s=d.decode_seq_s * factor,
            prefill_tokens_per_s=d.prefill_tokens_per_s / factor, prefill_fixed_s=d.prefill_fixed_s * factor,
        )  # fmt: skip
        return replace(self, demo=slow)


OVERLOAD_KNOBS = OverloadKnobs()


def demo_traffic(trace: Trace, k: OverloadKnobs = OVERLOAD_KNOBS) -> tuple[TraceRequest, ...]:
    """The requests as the demo sends them: prompts cut at ``max_prompt_tokens``, outputs shrunk
    (``demo_output_tokens``), arrivals from the first request's."""
    t0 = trace.requests[0].arrival_s if trace.requests else 0.0
    out = []
    for r in trace.requests:
        n = demo_output_tokens(r, k.demo)
        prompt = min(r.prompt_tokens, k.max_prompt_tokens)
        blocks = r.block_ids[: -(-prompt // trace.meta.block_tokens)]
        out.append(replace(r, arrival_s=r.arrival_s - t0, block_ids=blocks, prompt_tokens=prompt,
                           output_tokens=n, max_tokens=n))  # fmt: skip
    return tuple(out)


def offered_suffix_bytes_s(
    warm: Sequence[tuple[int, ...]],
    measured: Sequence[tuple[float, tuple[int, ...]]],
    kv_bytes_per_token: int,
    block_tokens: int,
) -> float:
    """KV bytes per second of the measured prompts' missing suffixes (``(arrival_s, tokens)``), with
    a prefix cache of ``block_tokens`` blocks that holds every earlier prompt (the warm-up's too)."""
    seen: set[tuple[int, ...]] = set()

    def missing(prompt: tuple[int, ...]) -> int:
        full = len(prompt) // block_tokens
        hit = 0
        while hit < full and prompt[: (hit + 1) * block_tokens] in seen:
            hit += 1
        for i in range(1, full + 1):
            seen.add(prompt[: i * block_tokens])
        return len(prompt) - hit * block_tokens

    for prompt in warm:
        missing(prompt)
    total = sum(missing(prompt) for _, prompt in measured)
    span = max(measured[-1][0] - measured[0][0], 1.0) if measured else 1.0
    return total * kv_bytes_per_token / span


def demo_line_mbit(trace: Trace, warmup: int, k: OverloadKnobs = OVERLOAD_KNOBS) -> float:
    """The line ``pddlink demo --scenario wan-overload`` sizes for this trace: ``1 / load`` of what
    the measured requests' missing suffixes offer (the first ``warmup`` only fill the cache)."""
    b = trace.meta.block_tokens
    prompts = [
        (r.arrival_s, tuple(r.prompt_token_ids(b, k.vocab_size)[: k.max_prompt_tokens]))
        for r in trace.requests
    ]
    warm, measured = prompts[:warmup], prompts[warmup:]
    t0 = measured[0][0] if measured else 0.0
    measured = [(t - t0, p) for t, p in measured]
    suffix = offered_suffix_bytes_s(
        [p for _, p in warm], measured, k.demo.kv_bytes_per_token, k.demo.block_tokens
    )
    return suffix * 8 / 1e6 / k.load


def overload_deployments(line_mbit: float, sla: Sla, k: OverloadKnobs = OVERLOAD_KNOBS) -> list[Deployment]:
    """``baseline``, ``pdd`` and ``unbounded`` on a ``line_mbit`` line, as the demo runs them."""
    cross, pdd = demo_deployments(replace(k.demo, line_mbit=line_mbit))
    md_chip = HardwareType("md", prefill_rel=1.0 / k.md_prefill_slowdown, decode_rel=1.0, price_rel=1.0)
    md = Pool(md_chip, cross.decode.gpus_per_instance, cross.decode.instances)
    cross, pdd = replace(cross, decode=md), replace(pdd, decode=md)
    admission = dict(deadline_s=WAN_SHARE_OF_DEADLINE * k.deadline_s, md_chunk_tokens=BLOCKING)
    recompute = replace(pdd.policy, recompute_enabled=True)
    unbounded = replace(pdd, name="unbounded", policy=recompute, **admission)  # type: ignore[arg-type]
    bounded = replace(
        unbounded, name="pdd", policy=replace(recompute, rld_token_budget=k.rld_token_budget),
        ttft_deadline_s=sla.ttft_s, tpot_bound_s=sla.tpot_s,
    )  # fmt: skip
    return [replace(cross, name="baseline"), bounded, unbounded]


def ranking(goodput: Mapping[str, float], tie_rps: float = TIE_RPS) -> list[list[str]]:
    """Policies from the highest goodput down, those within ``tie_rps`` of the group's best tied."""
    ordered = sorted(goodput, key=lambda n: -goodput[n])
    groups: list[list[str]] = []
    for name in ordered:
        if groups and goodput[groups[-1][0]] - goodput[name] <= tie_rps:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def ranking_agrees(predicted: Sequence[Sequence[str]], measured: Sequence[Sequence[str]]) -> bool:
    """No pair of policies is ordered one way by one ranking and the other way by the other (a tie
    on either side orders nothing)."""

    def rank(groups: Sequence[Sequence[str]]) -> dict[str, int]:
        return {name: i for i, g in enumerate(groups) for name in g}

    p, m = rank(predicted), rank(measured)
    names = sorted(set(p) & set(m))
    return all((p[a] - p[b]) * (m[a] - m[b]) >= 0 for i, a in enumerate(names) for b in names[i + 1 :])


def predict(
    trace: Trace, warmup: int, line_mbit: float, sla: Sla, k: OverloadKnobs = OVERLOAD_KNOBS
) -> dict[str, Any]:
    """Simulate the three policies on the demo's requests (the first ``warmup`` only warm the
    caches); per policy: goodput, TTFT P90, output speed, refused; and the goodput ranking."""
    requests = demo_traffic(trace, k)
    warm_end = requests[min(warmup, len(requests) - 1)].arrival_s if warmup else 0.0
    result, _ = run_deployments(
        requests, overload_deployments(line_mbit, sla, k), block_tokens=trace.meta.block_tokens, sla=sla,
        warmup_s=warm_end,
    )  # fmt: skip
    figures = {
        name: {
            "goodput_rps": d["goodput_rps"], "ttft_p90_s": d["ttft_s"]["p90"],
            "tokens_per_s_per_request": d["tokens_per_s_per_request"], "rejected": d["rejected"],
            "decisions": d["decisions"], "tpot_p50_s": d["tpot_s"]["p50"],
        }
        for name, d in result["deployments"].items()
    }  # fmt: skip
    goodput = {name: float(f["goodput_rps"]) for name, f in figures.items()}
    return {"policies": figures, "ranking": ranking(goodput), "line_mbit": round(line_mbit, 4)}
