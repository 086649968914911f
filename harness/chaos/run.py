"""``pddlink chaos``: a deployment as ``pddlink demo`` brings it up (P, RLD, MD and the router as
separate processes across a netlab WAN, mutual TLS between all of them), a bounded streaming load,
a fault schedule applied while it runs, then the invariants.

Lifecycle: lab up -> deployment up -> warm-up (the same mix, then one wave at the burst's peak
concurrency; after QUIET_S of quiet, once nothing is held anywhere, each process's RSS baseline:
the state the end is measured in too) -> load and faults together (a fault fires once its share of
the load has ended; a killed role is restarted on its ports, as a supervisor would, and gets the
same warm-up before its own baseline: as many requests of the load's mix, then the load is held,
the peak wave is sent again, and QUIET_S of quiet) -> 10 s of quiet, then what every process still
holds and its RSS -> deployment and lab down -> reference pass (one engine alone, separate
process) -> invariants, table, JSON, PNG timeline. Progress goes to stderr.

Why a restarted process gets the peak wave too: a process's quiet RSS after a wave of 4x the
concurrency is not its quiet RSS after the usual concurrency (allocator pools and buffers sized by
what was in flight keep part of that size), and the end's figure comes after the schedule's burst.
A restarted P whose baseline followed only the mix read x1.53-1.68 at the end while the first
processes, whose baseline followed the wave, stayed within x1.10 (issue 16).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engines_adapter import SamplingParams
from harness.chaos.invariants import FaultRecord, evaluate
from harness.chaos.load import StreamResult, drive
from harness.chaos.report import table, timeline
from harness.chaos.rss import RssBook, RssSampler
from harness.chaos.schedule import Fault, FaultKind, default_schedule
from harness.chaos.slow_clients import slow_clients_fault
from harness.cluster import Cluster, ClusterSpec
from harness.demo import VOCAB, reference_tokens, wan_profile
from harness.demo_workload import DemoRequest, build_trace, demo_requests
from netlab.lab import Lab
from netlab.profile import parse_profile
from pddlink.errors import PddlinkError
from pddlink.serving.http import fetch

WARMUP_MIN = 40  # requests before the RSS baseline (allocators and caches reach their size)
QUIET_S = 10.0  # after the load: what is still held then must be 0
REFERENCE_TIMEOUT_S = 480.0  # the reference pass of ~1,150 requests on one core of a busy machine
BURST_FACTOR = 3  # a burst adds this many times the concurrency at once: 4x in flight
ENGINE_DEATH_EXIT_S = 10.0  # a sidecar whose engine died has stopped by then
POOL_RETURN_S = 15.0  # a restarted role is back in the router's pool within this, or the fault says not
POOL_POLL_S = 0.1
PIPELINES = ("", "p_md", "p_rld_md", "singular")
HEAP_TYPES = 12  # the most numerous object types each heap figure names
SINGULAR_MAX_TOKENS = 4


def say(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def workload(requests: int, seed: int, max_output: int) -> list[tuple[DemoRequest, str]]:
    """Mixed pipelines, half greedy and half seeded sampling, agentic-v1 prompts (shared prefixes)."""
    trace = build_trace(requests=requests, rate_rps=50.0, seed=seed, workload=None, trace_file=None)
    out = []
    rng = random.Random(seed)
    for i, r in enumerate(demo_requests(trace, vocab_size=VOCAB, max_output=max_output)):
        pipeline = PIPELINES[i % len(PIPELINES)]
        s = r.sampling
        tokens = min(s.max_tokens, SINGULAR_MAX_TOKENS) if pipeline == "singular" else s.max_tokens
        greedy = rng.random() < 0.5
        sampling = SamplingParams(
            seed=s.seed, temperature=0.0 if greedy else s.temperature, top_k=s.top_k, max_tokens=tokens
        )
        out.append((replace(r, index=i, sampling=sampling), pipeline))
    return out


def admin_status(target: str, path: str = "/status") -> dict[str, Any]:
    try:
        code, body = fetch(target, "GET", path, timeout_s=5.0)
    except OSError as exc:
        return {"error": str(exc)}
    doc: dict[str, Any] = json.loads(body) if code == 200 else {"error": f"HTTP {code}"}
    return doc


def heap_of(cluster: Cluster, role: str) -> dict[str, Any]:
    """The role's own process's heap figures (its admin ``/memory``: ``pddlink.serving.malloc_trim``)."""
    target = cluster.router_unix if role == "router" else cluster.admin_socket(role)
    return admin_status("unix:" + target, f"/memory?types={HEAP_TYPES}")


def held_now(cluster: Cluster) -> dict[str, Any]:
    """kv_blocks: blocks MD's DRC pins for requests; leases: its live reservations; waiting: entries
    the decoders hold, requests the engines still run, P's transfers, the requests P's engine holds
    (prefilled, not yet released) and the router's requests."""
    docs = {role: admin_status("unix:" + cluster.admin_socket(role)) for role in ("p", "rld", "md")}
    docs["router"] = admin_status("unix:" + cluster.router_unix)
    drc = docs["md"].get("drc", {})
    waiting = sum(int(docs[r].get("state", {}).get("held", {}).get("requests", 0)) for r in ("rld", "md"))
    waiting += sum(int(docs[r].get("engine_active", 0)) for r in ("p", "rld", "md"))
    transfers = docs["p"].get("transfers", {})
    waiting += int(transfers.get("in_flight", 0)) + int(transfers.get("in_engine", 0))
    waiting += sum(int(n) for n in docs["router"].get("in_flight", {}).values())
    errors = {r: d["error"] for r, d in docs.items() if "error" in d}
    return {
        "kv_blocks": int(drc.get("pinned_blocks", 0)),
        "leases": int(drc.get("reservations", 0)),
        "waiting": waiting,
        **({"unreachable": errors} if errors else {}),
    }


def settled(cluster: Cluster, timeout_s: float = QUIET_S) -> dict[str, Any]:
    """Wait (at most ``timeout_s``) until no process holds anything for a request (``held_now``
    all 0), so an RSS baseline is taken in the state the end's figure is: nothing held, nothing in
    flight, P shipping nothing. What was still held then, if anything."""
    until = time.monotonic() + timeout_s
    while True:
        held = held_now(cluster)
        busy = {k: v for k, v in held.items() if k != "unreachable" and v}
        if not busy or time.monotonic() >= until:
            return busy
        time.sleep(0.25)


def router_in_flight(cluster: Cluster) -> int:
    """Requests the router has in flight now (its /status); -1 where it does not answer."""
    doc = admin_status("unix:" + cluster.router_unix)
    return sum(int(n) for n in doc.get("in_flight", {}).values()) if "error" not in doc else -1


class FaultRunner:
    def __init__(self, lab: Lab, cluster: Cluster, rss: RssBook, t0: float, profile: str) -> None:
        self.lab, self.cluster, self.rss, self.t0 = lab, cluster, rss, t0
        self.profile = profile  # the WAN's own profile (TOML), restored after a corruption
        self.records: list[FaultRecord] = []
        self.slow_clients: dict[str, Any] = {}  # the slow_clients fault's own record

    def now(self) -> float:
        return time.monotonic() - self.t0

    def apply(self, fault: Fault) -> None:
        start = self.now()
        say(f"[chaos] {start:6.1f} s  fault {fault.name}")
        note = self._do(fault)
        self.record(fault, start, note)
        if "restarted after" in note:
            self.rss.restarted(fault.target)

    def record(self, fault: Fault, start: float, note: str) -> None:
        self.records.append(FaultRecord(fault.name, fault.kind.value, fault.target, start, self.now(), note))
        say(f"[chaos] {self.now():6.1f} s  fault {fault.name} over {note}")

    def _do(self, fault: Fault) -> str:
        start = self.now()
        if fault.kind is FaultKind.KILL_RESTART:
            self.cluster.kill(fault.target)
            time.sleep(fault.duration_s)
            return self._restart(fault.target, start)
        if fault.kind is FaultKind.KILL_ENGINE:
            engines = self.cluster.pids(fault.target)[1:]
            if not engines:
                return "skipped: the engine runs in a thread (--engine-mode process to kill it)"
            os.kill(engines[0], signal.SIGKILL)
            proc = self.cluster.procs[fault.target]
            try:  # the sidecar notices, reports /healthz 503 and stops by itself
                code = proc.wait(ENGINE_DEATH_EXIT_S)
                gone = f"sidecar exited ({code}) {self.now() - start:.1f} s after its engine; "
            except subprocess.TimeoutExpired:
                gone = f"sidecar still running {ENGINE_DEATH_EXIT_S:g} s after its engine died; "
            return gone + self._restart(fault.target, start)
        if fault.kind is FaultKind.SLOW_CLIENTS:
            self.slow_clients = slow_clients_fault(
                self.cluster.router_unix, self.cluster.spec.deadline_s, self.t0
            )
            return str(self.slow_clients["note"])
        if fault.kind in (FaultKind.WAN_OUTAGE, FaultKind.ONE_WAY_CUT):
            self.lab.outage(fault.duration_s, "both" if fault.kind is FaultKind.WAN_OUTAGE else "a_to_b")
            time.sleep(fault.duration_s)
        elif fault.kind is FaultKind.CORRUPT:
            self.lab.set_profile(parse_profile(self.profile + "corrupt = 0.01\n", name="chaos-corrupt"))
            time.sleep(fault.duration_s)
            self.lab.set_profile(parse_profile(self.profile, name="pddlink-chaos"))
        return ""

    def _restart(self, role: str, start: float) -> str:
        """Start ``role`` again, then wait until the router has it back in its pool: the fault is
        over only then (a supervisor's restart is done when the role serves traffic again), so the
        requests that arrive after the fault had every role available."""
        try:
            self.cluster.restart(role)
        except PddlinkError as exc:  # recorded in the report; the run goes on
            return f"restart failed: {exc.message}"
        up = self.now() - start
        return f"restarted after {up:.1f} s, " + self._back_in_pool(role, start)

    def _back_in_pool(self, role: str, start: float) -> str:
        until = time.monotonic() + POOL_RETURN_S
        while time.monotonic() < until:
            roles = admin_status("unix:" + self.cluster.router_unix).get("roles", {})
            if roles.get(role, {}).get("usable"):
                return f"back in the router's pool after {self.now() - start:.1f} s"
            time.sleep(POOL_POLL_S)
        return f"not back in the router's pool {POOL_RETURN_S:g} s after its restart"


class Phases:
    """The load split at the faults' shares. Fault i fires once its phase's first ``concurrency``
    requests are in flight (and fault i-1 is over); phase i+1 starts only after fault i is over.
    So every fault meets a full set of requests in flight, whatever the load's size (CI) or the
    machine's speed, and requests keep arriving during a fault while its phase lasts.

    ``hold`` stops admissions until ``release``, for a restarted process's baseline; it begins only
    once the fault in progress is over (a P's warm-up wave met MD's engine kill, its requests failed
    fast, and its baseline read low: x1.36 at the end). A fault already due still fires during a
    hold: holding faults too moved RLD's kill to just before the long outage, which then met an RLD
    back for 0.3 s (outage share 0.66, against 0.98 with the schedule's own spacing)."""

    def __init__(self, schedule: Sequence[Fault], requests: int, concurrency: int) -> None:
        self.faults = sorted(schedule, key=lambda f: f.at_share)
        self.bounds = [round(f.at_share * requests) for f in self.faults] + [requests]
        self.concurrency = concurrency
        self.admitted = 0
        self.over = 0  # faults over
        self.firing = False  # a fault is due or being applied
        self.held = False
        self.changed = asyncio.Event()

    def phase(self, k: int) -> int:
        """-1 before the first fault's share, else the index of the fault whose phase k is in."""
        return sum(1 for b in self.bounds[:-1] if b <= k) - 1

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self.changed.clear()
            await self.changed.wait()

    async def admit(self, k: int) -> None:
        p = self.phase(k)
        await self._until(lambda: p <= self.over and not self.held)  # fault p-1 is over
        self.admitted += 1
        self.changed.set()

    async def hold(self) -> None:
        await self._until(lambda: not self.firing and not self.held)
        self.held = True
        self.changed.set()

    def release(self) -> None:
        self.held = False
        self.changed.set()

    def due(self, i: int) -> bool:
        full = min(self.bounds[i] + self.concurrency, self.bounds[i + 1])
        return self.over >= i and self.admitted >= full

    async def fire(self, apply: Callable[[Fault], None], burst: Callable[[Fault], Awaitable[None]]) -> None:
        for i, fault in enumerate(self.faults):
            await self._until(functools.partial(self.due, i))
            self.firing = True  # no hold begins from here until the fault is over
            await asyncio.sleep(0.3)  # the admitted requests' streams are open
            if fault.kind is FaultKind.BURST:
                await burst(fault)
            else:
                await asyncio.to_thread(apply, fault)
            self.firing = False
            self.over += 1
            self.changed.set()


async def load_and_faults(
    cluster: Cluster,
    faults: FaultRunner,
    reqs: list[tuple[DemoRequest, str]],
    schedule: Sequence[Fault],
    *,
    concurrency: int,
    deadline_s: float,
    extra: list[tuple[DemoRequest, str]],
    warm_peak: list[tuple[DemoRequest, str]],
) -> list[StreamResult]:
    """The load (``reqs``, ``concurrency`` at once) with the faults; a burst fault sends ``extra``
    all at once on top of it. A restarted process's warm-up ends, as the first warm-up did, with
    ``warm_peak`` all at once (its results are not the load's), then quiet and its baseline."""
    phases = Phases(schedule, len(reqs), concurrency)
    done = 0
    burst_results: list[StreamResult] = []

    async def burst(fault: Fault) -> None:
        start = faults.now()
        say(f"[chaos] {start:6.1f} s  fault {fault.name}: {len(extra)} requests on top")
        burst_results.extend(
            await drive(
                cluster.router_target, extra, concurrency=len(extra), deadline_s=deadline_s, t0=faults.t0
            )
        )
        faults.record(fault, start, f"{len(extra)} extra requests at once")

    loop = asyncio.get_running_loop()
    baselines: set[asyncio.Task[None]] = set()

    async def quiet_baseline(roles: list[str]) -> None:
        await phases.hold()
        say(
            f"[chaos] {faults.now():6.1f} s  {', '.join(roles)} warmed up again: quiet, then its RSS baseline"
        )
        await until_idle()
        if warm_peak:  # the first warm-up's last part: one wave at the burst's peak concurrency
            await drive(
                cluster.router_target,
                warm_peak,
                concurrency=len(warm_peak),
                deadline_s=deadline_s,
                t0=faults.t0,
            )
            await until_idle()
        await asyncio.sleep(QUIET_S)
        if busy := await asyncio.to_thread(settled, cluster):
            say(f"[chaos] {faults.now():6.1f} s  still held at {', '.join(roles)}'s baseline: {busy}")
        faults.rss.sample(cluster, roles)
        phases.release()

    async def until_idle() -> None:
        until = time.monotonic() + deadline_s + QUIET_S
        while time.monotonic() < until:
            if await asyncio.to_thread(router_in_flight, cluster) == 0:
                break
            await asyncio.sleep(0.2)

    def on_done(r: StreamResult) -> None:
        nonlocal done
        done += 1
        if due := faults.rss.on_done():
            baselines.add(loop.create_task(quiet_baseline(due)))
        if done % 50 == 0 or done == len(reqs):
            say(f"[chaos] {faults.now():6.1f} s  {done}/{len(reqs)} ended")

    load = asyncio.ensure_future(
        drive(
            cluster.router_target,
            reqs,
            concurrency=concurrency,
            deadline_s=deadline_s,
            t0=faults.t0,
            on_done=on_done,
            admit=phases.admit,
        )
    )
    firing = asyncio.ensure_future(phases.fire(faults.apply, burst))
    results = await load
    await firing  # every fault has begun (the phases see to it); the last one may still run
    await asyncio.gather(*baselines)  # each bounded: the wave, 2 x (deadline + QUIET_S), QUIET_S
    return results + burst_results


def main(
    *,
    requests: int,
    concurrency: int,
    deadline_s: float,
    json_path: str | None,
    plot_path: str,
    seed: int,
    line_mbit: float,
    rtt_ms: float,
    max_output: int,
    engine_mode: str = "process",
    schedule: Sequence[Fault] | None = None,
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="pddlink-chaos-"))
    spec = ClusterSpec(
        work / "run",
        relay=True,
        line_mbit=line_mbit,
        rtt_ms=rtt_ms,
        deadline_s=deadline_s,
        tls=True,
        engine_mode=engine_mode,
    )
    faults = list(default_schedule(deadline_s) if schedule is None else schedule)
    bursts = sum(f.kind is FaultKind.BURST for f in faults)
    reqs = workload(requests + bursts * BURST_FACTOR * concurrency, seed, max_output)
    warm = workload(max(WARMUP_MIN, 2 * concurrency), seed + 1, max_output)  # the same mix
    # the run's peak: a burst puts (1 + BURST_FACTOR) x concurrency in flight; the warm-up meets it
    # once too, so buffers sized by what is in flight have their size before the baseline
    peak = (1 + BURST_FACTOR) * concurrency if bursts else 0
    warm_peak = workload(peak, seed + 2, max_output) if peak else []
    say(f"chaos: {len(reqs)} requests, {concurrency} at once, deadline {deadline_s:g} s, faults: "
        + ", ".join(f.name for f in faults))  # fmt: skip
    lab = Lab.up(parse_profile(wan_profile(spec), name="pddlink-chaos"), name=f"chaos{os.getpid() % 100000}")
    try:
        with Cluster(lab, spec) as cluster:
            # a restarted process's own warm-up: as many requests, the peak wave, quiet
            rss = RssBook(len(warm), heap=functools.partial(heap_of, cluster))
            say(f"[chaos] deployment up ({lab.mode} lab, mutual TLS between all roles)")
            for batch, at_once in ((warm, concurrency), (warm_peak, peak)):
                if batch:
                    asyncio.run(
                        drive(
                            cluster.router_target,
                            batch,
                            concurrency=at_once,
                            deadline_s=deadline_s,
                            t0=time.monotonic(),
                        )
                    )
            say(f"[chaos] warm-up over; {QUIET_S:g} s of quiet, then each process's RSS baseline")
            time.sleep(QUIET_S)  # as before the end's figure: the same state, nothing in flight
            if busy := settled(cluster):
                say(f"[chaos] still held at the baseline: {busy}")
            rss.sample(cluster, ("p", "rld", "md", "router"))
            runner = FaultRunner(lab, cluster, rss, time.monotonic(), wan_profile(spec))
            sampler = RssSampler(cluster, runner.t0)
            with sampler:
                results = asyncio.run(
                    load_and_faults(
                        cluster,
                        runner,
                        reqs[:requests],
                        faults,
                        concurrency=concurrency,
                        deadline_s=deadline_s,
                        extra=reqs[requests:],
                        warm_peak=warm_peak,
                    )
                )
                say(f"[chaos] load over; {QUIET_S:g} s of quiet, then what is still held")
                time.sleep(QUIET_S)
                held = held_now(cluster)
                growth = rss.growth(cluster)
                parts = rss.parts_report(cluster)
                heaps = rss.heap_report(cluster)
    finally:
        lab.down()
    with open(work / "rss.jsonl", "w") as f:  # every process's RSS once a second: (s, role:pid, MiB)
        f.writelines(json.dumps(row) + "\n" for row in sampler.rows)
    with open(work / "requests.jsonl", "w") as f:  # per-request records, for diagnosis
        for r in results:
            row = {"index": r.index, "pipeline": r.pipeline, "start": r.started_s, "end": r.ended_s}
            row |= {"outcome": r.outcome, "reason": r.reason, "sources": r.sources, "trace": r.trace}
            f.write(json.dumps(row) + "\n")
    say("reference: one engine generating every request alone (separate process, float64)")
    reference = reference_tokens([r for r, _ in reqs], spec, work, timeout_s=REFERENCE_TIMEOUT_S)
    doc = evaluate(
        results, reference, [len(r.prompt) for r, _ in reqs], runner.records, deadline_s=deadline_s
    )
    doc["held_after_s10"] = held
    if runner.slow_clients:
        doc["slow_clients"] = runner.slow_clients
    doc["rss_growth_max"] = max((g for g in growth.values() if g is not None), default=0.0)
    doc["rss_growth"] = growth
    doc["rss_parts_mib"] = parts  # baseline and end split: anon (heaps), file, shmem
    doc["heap"] = heaps  # baseline and end: live Python blocks, malloc in use / free / mapped
    doc["rss_baseline_mib"] = {f"{role}:{pid}": round(b / 2**20, 1) for pid, (role, b) in rss.base.items()}
    doc["setting"] = {
        "concurrency": concurrency,
        "deadline_s": deadline_s,
        "line_mbit": line_mbit,
        "rtt_ms": rtt_ms,
        "lab_mode": lab.mode,
        "max_output_tokens": max_output,
        "engine_mode": engine_mode,
        "work_dir": str(work),
    }
    print(table(doc))
    timeline(results, runner.records, Path(plot_path))
    say(f"timeline: {plot_path}; logs: {work}")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    return doc
