"""The demo's requests: a trace (agentic-v1 generated, or a Mooncake/pddlink trace file) scaled to
this machine and turned into token-id prompts with sampling settings.

Scaling keeps the shape: the same block-sharing structure (so prefix hits arise on MD's DRC from
real shared prefixes), relative prompt lengths, arrival pattern and output-length distribution,
with 16-token blocks, ~768-token contexts and outputs divided by ``output_divisor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines_adapter import SamplingParams
from pddlink.sim.demo_scale import DemoKnobs, demo_output_tokens, replay_trace
from pddlink.sim.trace import Trace
from pddlink.sim.workload import load_workload

DEFAULT_WORKLOAD = Path("/work/shared/workload/agentic-v1.json")
BLOCK_TOKENS = 16
CONTEXT_TOKENS = 768


@dataclass(frozen=True, slots=True)
class DemoRequest:
    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    sampling: SamplingParams


def _workload_path(workload: str | None) -> str | Path:
    if workload:
        return workload
    if DEFAULT_WORKLOAD.exists():
        return DEFAULT_WORKLOAD
    return Path(__file__).resolve().parents[1] / "pddlink" / "sim" / "data" / "agentic-v1.json"


def build_trace(
    *, requests: int, rate_rps: float, seed: int, workload: str | None, trace_file: str | None
) -> Trace:
    """``pddlink.sim.demo_scale.replay_trace`` with the workload file (default agentic-v1)."""
    w = load_workload(_workload_path(workload))
    return replay_trace(requests=requests, rate_rps=rate_rps, seed=seed, workload=w, trace_file=trace_file)


def demo_requests(
    trace: Trace, *, vocab_size: int, output_divisor: int = 8, max_output: int = 128, max_prompt: int = 1500
) -> list[DemoRequest]:
    out = []
    t0 = trace.requests[0].arrival_s if trace.requests else 0.0
    for i, r in enumerate(trace.requests):
        prompt = r.prompt_token_ids(trace.meta.block_tokens, vocab_size)[:max_prompt]
        n = demo_output_tokens(r, DemoKnobs(output_divisor=output_divisor, max_output=max_output))
        sampling = SamplingParams(seed=1000 + i, temperature=0.8, top_k=64, max_tokens=n)
        out.append(DemoRequest(i, r.arrival_s - t0, tuple(prompt), sampling))
    return out
