"""``pddlink demo --engine vllm``: P->MD on real vLLM servers across netlab (see ``harness.vllm_demo``)."""

from __future__ import annotations

from pathlib import Path


def run_vllm_demo(
    *,
    json_path: str | None,
    seed: int,
    line_mbit: float,
    rtt_ms: float,
    sessions: int,
    turns: int,
    dtype: str,
    model: str | None,
    engine_args: str,
    concurrent: bool = False,
    lab_kind: str = "loopback",
) -> None:
    from harness.vllm_demo import VllmDemoSpec, run

    spec = VllmDemoSpec(
        sessions=sessions,
        turns=turns,
        seed=seed,
        line_mbit=line_mbit,
        rtt_ms=rtt_ms,
        dtype=dtype,
        model=Path(model) if model else None,
        extra_args=tuple(engine_args.split()),
        concurrent=concurrent,
    )
    run(spec, json_path, lab_kind)
