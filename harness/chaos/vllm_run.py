"""``pddlink chaos --engine vllm``: the chaos suite with vLLM servers in the roles.

P, RelayDecode and MD are vLLM servers (the tiny random Llama in float32, as ``pddlink demo
--engine vllm`` builds it), each beside its ``pddlink sidecar`` process (``VllmTrio``), P->MD across
a loopback netlab WAN; the router (``engine = "vllm"``) runs in this process and the load goes
through its ``generate``. Scaled to what two shared cores carry: a few requests at once, short
answers, a handful of faults.

Lifecycle: model, lab and trio up -> warm-up (the load's mix at its concurrency, then the same mix
while the WAN is cut as long as the run's long outage: the regions' and buffers' high-water mark is
reached before the baseline, as the reference suite's peak wave does), 10 s of quiet, each
sidecar's RSS baseline -> load and faults together (``Phases`` from the reference suite: a fault
fires once its phase's first requests are in flight, the next phase waits until it is over; while
a fault lasts, requests still arrive, one each ``FAULT_PACE_S`` and placed by the router alone: a
vLLM restart takes ~30 s here, and a closed loop of 4 would otherwise spend the rest of the load
failing fast against a dead P; a pipeline forced onto a dead MD would ship it KV that nobody
loads, which its sidecar holds until ``md_orphan_s``):
kill -9 and restart of MD's, RLD's and P's vLLM, a WAN outage shorter and one longer than the
deadline -> 10 s of quiet, then what every sidecar and the router still hold, and RSS -> the
reference (P's vLLM alone, greedy, the faults over) -> invariants (``harness.chaos.invariants``),
table, JSON, timeline.

What is measured for RSS: the pddlink processes (each role's sidecar), which live through every
engine restart and must not keep what a dead engine left. The vLLM servers' own RSS is reported
(``rss_engines_mib``), not judged: each is a new process after its restart, and vLLM touches its
preallocated KV pool as it fills it.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines_adapter import SamplingParams
from harness.chaos.invariants import evaluate
from harness.chaos.load import CLIENT_SLACK_S, StreamResult
from harness.chaos.report import table, timeline
from harness.chaos.rss import RssBook, rss_bytes
from harness.chaos.run import Phases
from harness.chaos.schedule import Fault, FaultKind
from harness.chaos.vllm_faults import VllmFaultRunner, held_now, legs_moved, say
from harness.demo_workload import DemoRequest
from harness.vllm.pair import VllmPair
from pddlink.errors import InvalidInput, PddlinkError
from router.admission import Overloaded
from router.answer import RequestEnd

QUIET_S = 10.0
SYSTEM_TOKENS = 256  # a system prompt every request shares (MD's and RLD's DRC hit it)
SESSIONS = 8  # each session's own context after it (its next turns hit it too)
VOCAB = 1000  # token ids below the tiny Llama's vocabulary (1024)
PIPELINES = ("", "p_md", "", "p_rld_md")  # half the router's own choice
FAULT_PACE_S = 2.0  # while a fault lasts, one new request each this long
LONG_OUTAGE = 1.2  # the long outage, in deadlines


@dataclass(frozen=True, slots=True)
class VllmChaosSpec:
    requests: int = 240
    concurrency: int = 4
    deadline_s: float = 20.0
    max_output: int = 16
    seed: int = 1
    line_mbit: float = 50.0
    rtt_ms: float = 10.0
    md_orphan_s: float = 8.0  # what a killed vLLM was sent after its death is swept this soon


def vllm_schedule(deadline_s: float) -> list[Fault]:
    """Kill -9 and restart of each vLLM server (MD, RLD, P); a WAN outage shorter than the deadline
    and one longer."""
    return [
        Fault(FaultKind.KILL_RESTART, 0.10, "md", 1.0),
        Fault(FaultKind.WAN_OUTAGE, 0.25, duration_s=0.3 * deadline_s, label="wan_outage_short"),
        Fault(FaultKind.KILL_RESTART, 0.40, "rld", 1.0),
        Fault(FaultKind.WAN_OUTAGE, 0.55, duration_s=LONG_OUTAGE * deadline_s, label="wan_outage_long"),
        Fault(FaultKind.KILL_RESTART, 0.70, "p", 1.0),
    ]


def workload(n: int, seed: int, max_output: int, first: int = 0) -> list[tuple[DemoRequest, str]]:
    """Greedy requests: the shared system prompt, a session's context, new tokens; short answers."""
    rng = random.Random(seed)
    system = tuple(rng.randrange(3, VOCAB) for _ in range(SYSTEM_TOKENS))
    contexts = [
        tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(64, 256))) for _ in range(SESSIONS)
    ]
    out = []
    for i in range(n):
        new = tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(16, 320)))
        prompt = system + contexts[i % SESSIONS] + new
        sampling = SamplingParams(max_tokens=rng.randrange(max(1, max_output // 2), max_output + 1))
        out.append((DemoRequest(first + i, 0.0, prompt, sampling), PIPELINES[i % len(PIPELINES)]))
    return out


async def one(router: Any, req: DemoRequest, pipeline: str, deadline_s: float, t0: float) -> StreamResult:
    """One request through the router, recorded as the reference suite's client records it."""
    res = StreamResult(req.index, pipeline, started_s=time.monotonic() - t0)

    async def stream() -> None:
        async for ev in router.generate(
            list(req.prompt), req.sampling, deadline_s=deadline_s, pipeline=pipeline
        ):
            if isinstance(ev, RequestEnd):
                res.outcome, res.reason = ev.outcome.value, ev.reason
                res.trace = dict(ev.trace)
                return
            res.positions.append(ev.position)
            res.tokens.append(ev.token_id)
            res.sources[ev.source] = res.sources.get(ev.source, 0) + 1
        res.outcome, res.reason = "failed", "stream closed without a closing event"

    try:
        await asyncio.wait_for(stream(), deadline_s + CLIENT_SLACK_S)
    except TimeoutError:
        res.outcome, res.reason = "hung", f"no closing event {CLIENT_SLACK_S:g} s after the deadline"
    except (Overloaded, InvalidInput) as exc:
        res.outcome, res.reason = "refused", f"{exc.code.name.lower()}: {exc.message}"
    except PddlinkError as exc:
        res.outcome, res.reason = "failed", f"{exc.code.name.lower()}: {exc.message}"
    res.ended_s = time.monotonic() - t0
    return res


async def drive(
    router: Any,
    reqs: Sequence[tuple[DemoRequest, str]],
    *,
    concurrency: int,
    deadline_s: float,
    t0: float,
    phases: Phases | None = None,
) -> list[StreamResult]:
    slots = asyncio.Semaphore(concurrency)
    pace = asyncio.Lock()
    issued = 0
    done = 0

    async def run(req: DemoRequest, pipeline: str) -> StreamResult:
        nonlocal issued, done
        async with slots:
            k, issued = issued, issued + 1
            if phases is not None:
                await phases.admit(k)
                if phases.firing:  # a fault lasts: requests keep arriving, at a walk, and
                    pipeline = ""  # go where the router finds the roles alive (no forced pipeline)
                    async with pace:
                        await asyncio.sleep(FAULT_PACE_S)
            res = await one(router, req, pipeline, deadline_s, t0)
        done += 1
        if done % 40 == 0 or done == len(reqs):
            say(f"[chaos] {time.monotonic() - t0:6.1f} s  {done}/{len(reqs)} ended")
        return res

    return list(await asyncio.gather(*(run(r, p) for r, p in reqs)))


def memory_of(trio: VllmPair, role: str) -> dict[str, Any]:
    """The sidecar's heap figures (its admin ``/memory``)."""
    try:
        out: dict[str, Any] = trio.sides()[role].get("/memory?types=8")
    except (PddlinkError, OSError) as exc:
        return {"error": str(exc)}
    return out


class Sidecars:
    """``harness.chaos.rss``'s view of the processes: each role's sidecar (the router is this one)."""

    def __init__(self, trio: VllmPair) -> None:
        self.trio = trio

    def pids(self, role: str) -> list[int]:
        side = self.trio.sides().get(role)
        return [side.proc.pid] if side is not None and side.proc is not None else []


def router_config(trio: VllmPair, spec: VllmChaosSpec) -> Any:
    from router import RouterConfig, VllmEngineConfig

    v = VllmEngineConfig(
        p_url=trio.servers()["p"].url,
        md_url=trio.servers()["md"].url,
        rld_url=trio.servers()["rld"].url,
        model=str(trio.spec.model),
        rld_gets_kv=True,
        md_kv_events=trio.md_kv_events,
    )
    return RouterConfig(
        engine="vllm",
        vllm=v,
        vocab_size=1024,
        recompute=False,
        line_mbit=spec.line_mbit,
        rtt_ms=spec.rtt_ms,
        deadline_s=spec.deadline_s,
        kv_bytes_per_token=2048,  # the tiny Llama in float32
    )


async def _router_in_flight(router: Any) -> int:
    return sum(int(n) for n in router.status().get("in_flight", {}).values())


async def _run(
    trio: VllmPair, spec: VllmChaosSpec, faults: list[Fault]
) -> tuple[dict[str, Any], list[StreamResult], list[Any]]:
    from router import Router

    router = Router(router_config(trio, spec))
    await router.start()
    try:
        warm = workload(6 * spec.concurrency, spec.seed + 1, spec.max_output, first=0)
        t = time.monotonic()
        await drive(router, warm, concurrency=spec.concurrency, deadline_s=spec.deadline_s, t0=t)
        outage_s = LONG_OUTAGE * spec.deadline_s
        say(f"[chaos] warm-up under a {outage_s:g} s WAN outage, as the run's long one")
        await asyncio.to_thread(trio.lab.outage, outage_s)  # type: ignore[attr-defined]
        cut = workload(6 * spec.concurrency, spec.seed + 2, spec.max_output, first=0)
        await drive(router, cut, concurrency=spec.concurrency, deadline_s=spec.deadline_s, t0=t)
        await asyncio.sleep(max(0.0, t + outage_s - time.monotonic()))
        await drive(router, warm, concurrency=spec.concurrency, deadline_s=spec.deadline_s, t0=t)
        say(f"[chaos] warm-up over; {QUIET_S:g} s of quiet, then each sidecar's RSS baseline")
        await asyncio.sleep(QUIET_S)
        procs = Sidecars(trio)
        rss = RssBook(len(warm), heap=lambda role: memory_of(trio, role))
        rss.sample(procs, ("p", "rld", "md"))
        reqs = workload(spec.requests, spec.seed, spec.max_output)
        t0 = time.monotonic()
        runner = VllmFaultRunner(trio, router.backend.usable, t0)
        phases = Phases(faults, len(reqs), spec.concurrency)

        async def apply(fault: Fault) -> None:
            await asyncio.to_thread(runner.apply, fault)

        async def burst(fault: Fault) -> None:  # not in the vLLM schedule
            await apply(fault)

        load = asyncio.ensure_future(
            drive(
                router, reqs, concurrency=spec.concurrency, deadline_s=spec.deadline_s, t0=t0, phases=phases
            )
        )
        firing = asyncio.ensure_future(phases.fire(runner.apply, burst))
        results = await load
        await firing
        say(f"[chaos] load over; {QUIET_S:g} s of quiet, then what is still held")
        await asyncio.sleep(QUIET_S)
        held = await asyncio.to_thread(held_now, trio, await _router_in_flight(router))
        growth = rss.growth(procs)
        parts, heaps = rss.parts_report(procs), await asyncio.to_thread(rss.heap_report, procs)
        engines = {role: round(rss_bytes(s.pid) / 2**20, 1) for role, s in trio.servers().items()}
        say("reference: P's vLLM generating every request alone (greedy, float32)")
        reference = await _reference(trio, [r for r, _ in reqs], spec.concurrency)
    finally:
        await router.close()
    doc = evaluate(
        results, reference, [len(r.prompt) for r, _ in reqs], runner.records, deadline_s=spec.deadline_s
    )
    doc["held_after_s10"] = held
    doc["after_restart"] = runner.after_restart
    doc["rss_growth_max"] = max((g for g in growth.values() if g is not None), default=0.0)
    doc["rss_growth"] = growth
    doc["rss_baseline_mib"] = {f"{role}:{pid}": round(b / 2**20, 1) for pid, (role, b) in rss.base.items()}
    doc["rss_parts_mib"] = parts  # baseline and end: anon (heaps), file, shmem (the KV regions)
    doc["heap"] = heaps
    doc["rss_engines_mib"] = engines
    doc["sidecars"] = await asyncio.to_thread(trio.status)
    doc["p_legs_moved_after_restart"] = legs_moved(runner.p_legs_at, doc["sidecars"]["p"].get("legs", {}))
    return doc, results, runner.records


async def _reference(trio: VllmPair, reqs: Sequence[DemoRequest], concurrency: int) -> list[tuple[int, ...]]:
    import httpx

    from router.vllm_legs import generate_alone

    slots = asyncio.Semaphore(concurrency)
    p = trio.servers()["p"].url

    async def alone(http: httpx.AsyncClient, r: DemoRequest) -> tuple[int, ...]:
        async with slots:
            return await generate_alone(http, p, str(trio.spec.model), r.prompt, r.sampling, deadline_s=120.0)

    async with httpx.AsyncClient(timeout=None) as http:
        return list(await asyncio.gather(*(alone(http, r) for r in reqs)))


def restart_table(doc: dict[str, Any]) -> str:
    lines = ["", "after each vLLM restart, its sidecar held (before new traffic):"]
    for role, held in doc["after_restart"].items():
        lines.append(f"  {role:<4} " + ", ".join(f"{k} {v}" for k, v in held.items()))
    for role, legs in doc["p_legs_moved_after_restart"].items():
        moved = ", ".join(f"{leg} {'yes' if m else 'NO'}" for leg, m in legs.items())
        lines.append(f"P's legs shipped more after {role}'s restart: {moved}")
    return "\n".join(lines)


def main(spec: VllmChaosSpec, json_path: str | None, plot_path: str, keep: bool = False) -> dict[str, Any]:
    import vllm.distributed.kv_events  # noqa: F401  (imported before the loop runs, as the tests do)

    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama
    from harness.vllm_trio import trio_across_lab

    root = Path(tempfile.mkdtemp(prefix="pddlink-vchaos-"))  # unix socket paths: keep it short
    faults = vllm_schedule(spec.deadline_s)
    say(
        f"chaos (vLLM): {spec.requests} requests, {spec.concurrency} at once, "
        f"deadline {spec.deadline_s:g} s, faults: " + ", ".join(f.name for f in faults)
    )
    model = build_tiny_llama(root / "model", TinyLlamaSpec(dtype="float32"))
    link = f"[link]\ndelay_ms = {spec.rtt_ms / 2}\nrate_mbit = {spec.line_mbit}\nqueue_packets = 400\n"
    try:
        with trio_across_lab(root / "w", model, link, "vchaos", md_orphan_s=spec.md_orphan_s) as trio:
            say(f"[chaos] P, RLD and MD up as vLLM servers beside their sidecars; logs: {root / 'w'}")
            doc, results, records = asyncio.run(_run(trio, spec, faults))
    finally:
        if not keep:
            shutil.rmtree(root / "model", ignore_errors=True)
    doc["engine"] = "vllm"
    doc["setting"] = {
        "concurrency": spec.concurrency,
        "deadline_s": spec.deadline_s,
        "line_mbit": spec.line_mbit,
        "rtt_ms": spec.rtt_ms,
        "lab_mode": "loopback",
        "max_output_tokens": spec.max_output,
        "work_dir": str(root),
    }
    print(table(doc) + restart_table(doc))
    timeline(results, records, Path(plot_path))
    say(f"timeline: {plot_path}; logs: {root / 'w'}")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1, default=str))
    return doc
