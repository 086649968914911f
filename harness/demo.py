"""``pddlink demo``: P, RLD, MD and the router as separate processes across an emulated WAN,
replaying one workload twice (cross-datacenter P->MD baseline, then PDD) on fresh deployments,
then checking every generated token against one engine generating alone. ``--scenario
wan-overload`` replays it three times: the baseline, PDD whose router holds the SLO (``pdd``:
``RouterConfig.slo_ttft_ms``/``slo_tpot_ms``, RLD's token share under ``RLD_TOKEN_BUDGET``), and PDD
recomputing without a decode-speed bound (``unbounded``); every run's goodput counts against the
same SLO.

Lifecycle: lab up (namespaces as root, loopback otherwise) -> for each run: deployment up, open-
loop replay, deployment down -> reference pass (separate process) -> table, JSON, PNG -> lab down.
Ctrl-C or any error still stops every process and removes the lab.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from harness.cluster import Cluster, ClusterSpec, datacenter_cpus
from harness.demo_load import RequestResult, replay
from harness.demo_overload import offered_suffix_bytes_s, overload_line_mbit
from harness.demo_report import Slo, document, plot, summarize, table
from harness.demo_workload import DemoRequest, build_trace, demo_requests
from netlab.lab import Lab
from netlab.profile import parse_profile
from pddlink.serving.http import fetch
from pddlink.sim.demo_overload import OVERLOAD_KNOBS, predict, ranking, ranking_agrees
from pddlink.sim.demo_scale import DemoKnobs, single_demo_knobs
from pddlink.sim.records import Sla
from pddlink.sim.trace import Trace

VOCAB = 2048  # the reference engine's tiny preset
KV_BYTES_PER_TOKEN = 2048
# the router's starting figure for MD's and RLD's time per token in the wan-overload scenario, where
# its TPOT bound judges them (the router refines both from the requests they finish): what the tiny
# preset took at a small batch when it was set. MD now decodes in 1.4-2.2 ms, but RLD shares P's CPU
# and its relays ran at 2-13 ms: started from MD's measured figure, the conversation trace's bounded
# run relayed 2 requests that decoded over the 10 ms bound on RLD (none from 8 ms, 2026-12-06)
TINY_TPOT_S = 0.008
# wan-overload's PDD router: RelayDecode's share of the output tokens it may take over from MD
# under the TPOT bound. A relayed request's KV crosses the thin line late or not at all, so the
# conversation's next turn finds on MD less than P holds: at 0.15 MD's DRC hit fell 4.5 to 9.3
# points under P's (the overload check allows 5), with RLD's share at 17%
RLD_TOKEN_BUDGET = 0.08


def sim_prediction(
    trace: Trace,
    warmup: int,
    line_mbit: float,
    slo: Slo,
    measured: dict[str, float],
    base_tpot_s: float,
    md_prefill_slowdown: float = 1.0,
) -> dict[str, Any]:
    """The simulator on the same requests, line and SLO (``pddlink.sim.demo_overload``): its
    goodput ranking of the three policies beside the one this run measured, with the tiny engine
    scaled to the baseline TPOT P50 this run saw (``base_tpot_s``; ``slowdown``: its step time over
    the one the simulator was calibrated at, < 1 for a faster engine: the machine is shared, the
    engine has got faster since, and how much recompute costs and what the SLO allows follow its
    speed), and (``at_calibrated_speed``) at the calibrated speed."""
    sla = Sla(slo.ttft_ms / 1e3, slo.tpot_ms / 1e3)
    knobs = replace(OVERLOAD_KNOBS, md_prefill_slowdown=md_prefill_slowdown)  # MD's chips as the demo's
    calibrated = predict(trace, warmup, line_mbit, sla, knobs)
    calibrated_tpot_s = calibrated["policies"]["baseline"]["tpot_p50_s"]
    slowdown = base_tpot_s / calibrated_tpot_s if calibrated_tpot_s and base_tpot_s > 0 else 1.0
    predicted = (
        predict(trace, warmup, line_mbit, sla, knobs.slowed(slowdown)) if slowdown != 1.0 else calibrated
    )
    order = ranking(measured)
    agrees = ranking_agrees(predicted["ranking"], order)
    calibrated = {**calibrated, "agrees": ranking_agrees(calibrated["ranking"], order)}
    verdict = "agree" if agrees else "DIFFER"
    say(f"simulator: goodput ranking {predicted['ranking']}, measured {order}: {verdict}")
    return {
        **predicted,
        "slowdown": round(slowdown, 3),
        "measured_ranking": order,
        "agrees": agrees,
        "at_calibrated_speed": calibrated,
    }


def say(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def wan_profile(spec: ClusterSpec) -> str:
    return (
        f'description = "pddlink demo WAN: {spec.line_mbit:g} Mbit/s, {spec.rtt_ms:g} ms RTT"\n'
        f"[link]\ndelay_ms = {spec.rtt_ms / 2}\nrate_mbit = {spec.line_mbit}\nqueue_packets = 200\n"
    )


def run_once(
    lab: Any,
    spec: ClusterSpec,
    warmup: list[DemoRequest],
    requests: list[DemoRequest],
    label: str,
    deployment: Any = Cluster,  # Cluster, or harness.demo_compose.ComposeDeployment
    warm_pipeline: str = "p_md",
) -> Replayed:
    """One replay on a fresh deployment: the results, the sidecars' counters over it, its wall time."""
    t0 = time.monotonic()
    with deployment(lab, spec) as cluster:
        say(f"[{label}] deployment up in {time.monotonic() - t0:.1f} s ({lab.mode} lab)")
        if warmup:
            t1 = time.monotonic()
            paced = [replace(r, arrival_s=0.4 * i) for i, r in enumerate(warmup)]
            warm = asyncio.run(
                replay(
                    cluster.router_target,
                    paced,
                    deadline_s=spec.deadline_s,
                    pipeline=warm_pipeline,
                    id_prefix="w",
                )
            )
            bad = sum(r.outcome != "finished" for r in warm)
            took = time.monotonic() - t1
            how = "P->MD" if warm_pipeline == "p_md" else f"by {warm_pipeline} (no KV on the WAN)"
            say(f"[{label}] warm-up: {len(warm)} requests {how} in {took:.1f} s ({bad} failed)")
        before = sidecar_counters(cluster)
        bar = tqdm(total=len(requests), desc=label, file=sys.stderr, unit="req", leave=True)
        failed = 0

        def done(r: RequestResult) -> None:
            nonlocal failed
            failed += r.outcome != "finished"
            bar.update(1)
            bar.set_postfix(failed=failed)

        t_replay = time.monotonic()
        try:
            results = asyncio.run(
                replay(cluster.router_target, requests, deadline_s=spec.deadline_s, on_done=done)
            )
        finally:
            bar.close()
        replay_s = time.monotonic() - t_replay
        with open(spec.run_dir / "requests.jsonl", "w") as f:  # per-request records, for diagnosis
            for r in results:
                f.write(
                    json.dumps(
                        {
                            "index": r.index,
                            "ttft_s": r.ttft_s,
                            "e2e_s": r.e2e_s,
                            "outcome": r.outcome,
                            "reason": r.reason,
                            "sources": r.sources,
                            "trace": r.trace,
                        }
                    )
                    + "\n"
                )
        time.sleep(1.0)  # shipments that outlive their request (RLD finished it) land on MD
        after = sidecar_counters(cluster)
    return Replayed(results, {k: after[k] - before.get(k, 0.0) for k in after}, replay_s)


@dataclass(frozen=True, slots=True)
class Replayed:
    """One run: the measured requests' results, the sidecars' counters over them, the replay's wall time."""

    results: list[RequestResult]
    counters: dict[str, float]
    replay_s: float


def sidecar_counters(cluster: Any) -> dict[str, float]:
    """WAN/fast-path KV bytes from P's /metrics and DRC lookups from MD's, as counters to diff."""
    out: dict[str, float] = {}
    for role in ("p", "md"):
        code, text = fetch("unix:" + cluster.admin_socket(role), "GET", "/metrics")
        if code != 200:
            continue
        for fam in text_string_to_metric_families(text.decode()):
            for sample in fam.samples:
                if role == "p" and sample.name == "pddlink_kv_bytes_total":
                    out[f"kv_bytes_{sample.labels['path']}"] = sample.value
                if role == "p" and sample.name in (
                    "pddlink_kv_wire_bytes_total",
                    "pddlink_kv_codec_raw_bytes_total",
                ):
                    kind = "wire" if "wire" in sample.name else "raw"
                    out[f"codec_{kind}_{sample.labels['path']}_{sample.labels['codec']}"] = sample.value
                if role == "md" and sample.name in (
                    "pddlink_drc_hit_blocks_total",
                    "pddlink_drc_lookup_blocks_total",
                ):
                    out[sample.name[len("pddlink_") : -len("_total")]] = sample.value
    return out


def reference_tokens(
    requests: list[DemoRequest], spec: ClusterSpec, work: Path, timeout_s: float = 240.0
) -> list[list[int]]:
    job = {
        "engine": {"preset": spec.preset, "dtype": spec.dtype, "block_size": 16, "num_blocks": 4096},
        "requests": [{"prompt": list(r.prompt), "sampling": r.sampling.to_dict()} for r in requests],
    }
    (work / "reference_in.json").write_text(json.dumps(job))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.demo_reference",
            str(work / "reference_in.json"),
            str(work / "reference.json"),
        ],
        check=True,
        timeout=timeout_s,
    )
    tokens: list[list[int]] = json.loads((work / "reference.json").read_text())["tokens"]
    return tokens


def main(
    *,
    requests: int,
    rate_rps: float,
    trace: str | None,
    workload: str | None,
    json_path: str | None,
    plot_path: str,
    seed: int,
    line_mbit: float,
    rtt_ms: float,
    warmup: int,
    engine_mode: str = "thread",
    scenario: str = "default",
    lab_kind: str = "auto",
    slo: Slo | None = None,
    md_prefill_slowdown: float = 1.0,
) -> dict[str, Any]:
    slo = slo or Slo()
    work = Path(tempfile.mkdtemp(prefix="pddlink-demo-"))
    replayed = build_trace(
        requests=requests + warmup, rate_rps=rate_rps, seed=seed, workload=workload, trace_file=trace
    )
    overload = scenario == "wan-overload"
    k = DemoKnobs() if overload else single_demo_knobs()  # wan-overload is calibrated on 8 and 128
    every = demo_requests(
        replayed, vocab_size=VOCAB, output_divisor=k.output_divisor, max_output=k.max_output
    )
    warm, reqs = every[:warmup], every[warmup:]
    t_first = reqs[0].arrival_s
    reqs = [replace(r, index=i, arrival_s=r.arrival_s - t_first) for i, r in enumerate(reqs)]
    mean_prompt = sum(len(r.prompt) for r in reqs) / len(reqs)
    suffix_bytes_s = offered_suffix_bytes_s(warm, reqs, KV_BYTES_PER_TOKEN)
    if overload:  # the line carries half of what the missing suffixes need
        line_mbit = overload_line_mbit(suffix_bytes_s)
    spec = ClusterSpec(
        work / "baseline",
        relay=False,
        line_mbit=line_mbit,
        rtt_ms=rtt_ms,
        engine_mode=engine_mode,
        cpus=datacenter_cpus(),  # MD's datacenter has chips of its own, as P's has
        md_prefill_slowdown=md_prefill_slowdown,  # > 1: MD's chips are poor at prefill (emulated)
    )
    wan_load = suffix_bytes_s * 8 / 1e6 / line_mbit
    say(f"scenario {scenario}: missing suffixes offer {wan_load:.2f}x the line's rate")
    say(
        f"workload: {len(reqs)} requests over {reqs[-1].arrival_s:.0f} s, mean prompt {mean_prompt:.0f}"
        f" tokens, {sum(r.sampling.max_tokens for r in reqs)} output tokens; "
        f"{'trace ' + trace if trace else 'agentic-v1'} scaled to this machine; the {warmup} requests before"
        f" them warm P's and MD's prefix caches ({'by recompute' if overload else 'P->MD'}, not counted)"
    )
    say(
        f"WAN: {line_mbit:g} Mbit/s, {rtt_ms:g} ms RTT; model: reference 'tiny' in float64, "
        f"2048 B of KV per token, so a prompt's full KV ({mean_prompt * 2048 / 1e6:.1f} MB) takes "
        f"{mean_prompt * 2048 * 8 / (line_mbit * 1e6):.2f} s on the line: the WAN is the bottleneck "
        "for low-hit requests, as in the published setting"
    )
    cpus = dict(spec.cpus)
    chip = (
        f"; prefill {spec.md_prefill_slowdown:g}x slower than P's (emulated)"
        if spec.md_prefill_slowdown > 1
        else ""
    )
    say(f"CPUs: MD {cpus.get('md', 'any')}, P, RLD and the router {cpus.get('p', 'any')}{chip}")
    profile, lab_name = parse_profile(wan_profile(spec), name="pddlink-demo"), f"demo{os.getpid() % 100000}"
    lab: Any
    deployment: Any
    lab_figures: dict[str, Any]
    if lab_kind == "compose":  # every role in its own container, the WAN a netlab relay container
        from harness.demo_compose import open_lab

        lab, deployment, lab_figures = open_lab(profile, lab_name, say)
    else:
        lab, deployment, lab_figures = Lab.up(profile, name=lab_name, mode=lab_kind), Cluster, {}
    try:
        # over the thin line a P->MD warm-up cannot ship (and would leave MD colder than P): there
        # MD prefills the warm-up prompts itself, P too, in both runs alike
        warm_how = "recompute" if overload else "p_md"
        base_run = run_once(lab, spec, warm, reqs, "P->MD baseline", deployment, warm_how)
        pdd_spec = replace(spec, run_dir=work / "pdd", relay=True, recompute=overload, admission=overload)
        unbounded_spec = None
        if overload:  # both PDD runs start from the tiny engine's time per token; PDD holds the SLO
            unbounded_spec = replace(
                pdd_spec, run_dir=work / "unbounded", md_tpot_s=TINY_TPOT_S, rld_tpot_s=TINY_TPOT_S
            )
            pdd_spec = replace(
                unbounded_spec,
                run_dir=work / "pdd",
                slo_ttft_ms=slo.ttft_ms,
                slo_tpot_ms=slo.tpot_ms,
                rld_token_budget=RLD_TOKEN_BUDGET,
            )
        pdd_run = run_once(lab, pdd_spec, warm, reqs, "PDD", deployment, warm_how)
        unbounded_run = None
        if unbounded_spec is not None:  # the same without the SLO: recompute whenever sooner
            unbounded_run = run_once(lab, unbounded_spec, warm, reqs, "PDD unbounded", deployment, warm_how)
    finally:
        lab.down()
    say("reference: one engine generating every request alone (separate process, float64)")
    reference = reference_tokens(reqs, spec, work)
    base, pdd, unbounded = (
        summarize(run.results, reference, run.counters, slo, run.replay_s) if run else None
        for run in (base_run, pdd_run, unbounded_run)
    )
    assert base is not None and pdd is not None
    setting = {
        "line_mbit": line_mbit,
        "rtt_ms": rtt_ms,
        "lab_mode": lab.mode,
        "model": "torch_ref tiny float64",
        "kv_bytes_per_token": 2048,
        "rate_rps": rate_rps,
        "engine_mode": engine_mode,
        "work_dir": str(work),
        "scenario": scenario,
        "wan_load": round(wan_load, 3),
        "pdd_recompute": overload,
        "md_prefill_slowdown": spec.md_prefill_slowdown,
        "pdd_admission": overload,
        "slo": asdict(slo),  # what goodput counts against (defaults: harness.demo_report.Slo)
        "pdd_slo_in_router": overload,  # "unbounded" (wan-overload's third run): it does not
        "pdd_rld_token_budget": RLD_TOKEN_BUDGET if overload else None,
        **lab_figures,
    }
    other = ("unbounded", unbounded) if unbounded else None
    doc = document(base, pdd, setting, other)
    if unbounded is not None:
        tpot = base["tpot_s"]["p50"]
        doc["sim_prediction"] = sim_prediction(
            replayed, warmup, line_mbit, slo, doc["goodput_rps"], tpot, spec.md_prefill_slowdown
        )
    print(table(doc))
    plot(base, pdd, Path(plot_path), other)
    say(f"TTFT distributions: {plot_path}; logs: {work}")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    return doc
