"""``pddlink chaos --topology F``: faults of one instance out of several, on a topology's pools
(``harness.pool_cluster``: one reference-engine sidecar per instance, one router over them all,
every WAN link a netlab loopback relay of its own, mutual TLS per instance).

Lifecycle: WAN links up -> pools up -> a short warm-up (the mirrors fill) -> the load with the
schedule (``pool_schedule``): kill -9 of one MD of a datacenter's two, then of one P of two, each
started again on its ports after ``KILL_DOWN_S`` (as a supervisor would); then an operator's drain
of another MD until what runs on it has ended, and its undrain -> 10 s of quiet, then what every
process still holds -> down -> reference pass (one engine alone) -> the chaos invariants
(``harness.chaos.invariants``) and the pool measures (``harness.chaos.pool_measures``), table,
JSON, PNG timeline. A restarted instance's rejoin time runs from the moment it is up again
(READY) to the first request the router places on it (its ``placed`` count in /status), watched
beside the load that follows the fault (the next phase begins once the instance is up).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.chaos.invariants import FaultRecord, evaluate
from harness.chaos.load import StreamResult, drive
from harness.chaos.pool_measures import pool_measures
from harness.chaos.report import timeline
from harness.chaos.run import QUIET_S, Phases, admin_status, say, workload
from harness.chaos.schedule import Fault, FaultKind
from harness.cluster import ClusterSpec
from harness.demo import reference_tokens
from harness.demo_pools import LoopbackWan
from harness.pool_cluster import PoolCluster, PoolSpec
from pddlink.errors import PddlinkError
from pddlink.roles import Role
from pddlink.serving.http import fetch
from pddlink.topology import Topology, load_topology

KILL_DOWN_S = 2.0  # a killed instance stays down this long, then starts again
REJOIN_WAIT_S = 30.0  # how long a restarted instance's first placed request is waited for
DRAIN_MIN_S = 2.0  # a drain lasts at least this long (new requests must find it out)
REFERENCE_TIMEOUT_S = 480.0
POLL_S = 0.1


def pool_schedule(topology: Topology, deadline_s: float) -> list[Fault]:
    """Kill -9 of the first MD of a datacenter that has two or more, of the first P when there
    are two or more, and a drain of an MD in another datacenter (or another MD of the same)."""
    faults = []
    mds = topology.members(Role.MD)
    by_dc: dict[str, list[str]] = {}
    for m in mds:
        by_dc.setdefault(m.datacenter, []).append(m.name)
    pair = next((names for names in by_dc.values() if len(names) >= 2), [m.name for m in mds])
    killed_md = pair[0] if len(mds) >= 2 else ""
    if killed_md:
        faults.append(Fault(FaultKind.KILL_INSTANCE, 0.15, killed_md, KILL_DOWN_S, f"kill:{killed_md}"))
    ps = topology.members(Role.P)
    if len(ps) >= 2:
        faults.append(Fault(FaultKind.KILL_INSTANCE, 0.45, ps[0].name, KILL_DOWN_S, f"kill:{ps[0].name}"))
    others = [m for m in mds if m.name not in pair] or [m for m in mds if m.name != killed_md]
    if len(mds) >= 2 and others:
        faults.append(Fault(FaultKind.DRAIN, 0.75, others[0].name, label=f"drain:{others[0].name}"))
    return faults


def instances(pools: PoolCluster) -> dict[str, dict[str, Any]]:
    """The router's view of every instance (/status): placed, running, in_placement, health."""
    doc = admin_status("unix:" + pools.router_unix)
    dcs = doc.get("topology", {}).get("datacenters", [])
    return {i["name"]: i for dc in dcs for role in ("p", "rld", "md") for i in dc.get(role, [])}


def held_now(pools: PoolCluster) -> dict[str, Any]:
    """As ``harness.chaos.run.held_now``, summed over every instance: blocks MDs' DRCs pin for
    requests, their live reservations, and every entry, engine request and transfer still held."""
    kv_blocks = leases = waiting = 0
    errors = {}
    for name, m in pools.members.items():
        doc = admin_status("unix:" + pools.admin_socket(name))
        if "error" in doc:
            errors[name] = doc["error"]
            continue
        if m.role is Role.MD:
            drc = doc.get("drc", {})
            kv_blocks += int(drc.get("pinned_blocks", 0))
            leases += int(drc.get("reservations", 0))
        if m.role is not Role.P:
            waiting += int(doc.get("state", {}).get("held", {}).get("requests", 0))
        else:
            transfers = doc.get("transfers", {})
            waiting += int(transfers.get("in_flight", 0)) + int(transfers.get("in_engine", 0))
        waiting += int(doc.get("engine_active", 0))
    router = admin_status("unix:" + pools.router_unix)
    waiting += sum(int(n) for n in router.get("in_flight", {}).values())
    out: dict[str, Any] = {"kv_blocks": kv_blocks, "leases": leases, "waiting": waiting}
    if errors:
        out["unreachable"] = errors
    return out


class PoolFaults:
    """Applies the pool schedule's faults (blocking: run in a thread beside the load)."""

    def __init__(self, pools: PoolCluster, t0: float, deadline_s: float) -> None:
        self.pools, self.t0, self.deadline_s = pools, t0, deadline_s
        self.records: list[FaultRecord] = []
        self.rejoin_s: dict[str, float | None] = {}
        self.restart_s: dict[str, float] = {}  # launch to READY
        self.watchers: list[threading.Thread] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def apply(self, fault: Fault) -> None:
        start = self.now()
        say(f"[chaos] {start:6.1f} s  fault {fault.name}")
        note = (
            self._kill(fault.target) if fault.kind is FaultKind.KILL_INSTANCE else self._drain(fault.target)
        )
        self.records.append(FaultRecord(fault.name, fault.kind.value, fault.target, start, self.now(), note))
        say(f"[chaos] {self.now():6.1f} s  fault {fault.name} over: {note}")

    def _kill(self, name: str) -> str:
        """Kill -9, down ``KILL_DOWN_S``, start again; the fault is over once it is up (READY): its
        rejoin is watched beside the load that follows (``rejoined``), which is what places on it."""
        self.pools.kill(name)
        time.sleep(KILL_DOWN_S)
        before = int(instances(self.pools).get(name, {}).get("placed", 0))
        launched = time.monotonic()
        try:
            self.pools.start_again(name)
        except PddlinkError as exc:
            self.rejoin_s[name] = None
            return f"restart failed: {exc.message}"
        up = time.monotonic()
        self.restart_s[name] = round(up - launched, 2)
        self.rejoin_s[name] = None
        watcher = threading.Thread(target=self._rejoin, args=(name, before, up), daemon=True)
        watcher.start()
        self.watchers.append(watcher)
        return f"up {up - launched:.1f} s after its restart"

    def _rejoin(self, name: str, before: int, up: float) -> None:
        while time.monotonic() < up + REJOIN_WAIT_S:
            if int(instances(self.pools).get(name, {}).get("placed", 0)) > before:
                took = self.rejoin_s[name] = round(time.monotonic() - up, 2)
                say(f"[chaos] {self.now():6.1f} s  {name} placed on again {took:.1f} s after it was up")
                return
            time.sleep(POLL_S)
        say(f"[chaos] {self.now():6.1f} s  {name}: nothing placed on it {REJOIN_WAIT_S:g} s after it was up")

    def rejoined(self) -> None:
        """Wait for every rejoin watch (each ends within ``REJOIN_WAIT_S``)."""
        for watcher in self.watchers:
            watcher.join()

    def _drain(self, name: str) -> str:
        target = "unix:" + self.pools.router_unix
        code, body = fetch(target, "POST", "/admin/drain", json.dumps({"instance": name}).encode())
        if code != 200:
            return f"drain refused: HTTP {code} {body[:200]!r}"
        began = time.monotonic()
        until = began + self.deadline_s + QUIET_S
        running = -1
        while time.monotonic() < until:
            running = int(instances(self.pools).get(name, {}).get("running", 0))
            if running == 0 and time.monotonic() >= began + DRAIN_MIN_S:
                break
            time.sleep(POLL_S)
        fetch(target, "POST", "/admin/undrain", json.dumps({"instance": name}).encode())
        return f"drained for {time.monotonic() - began:.1f} s ({running} still running at the undrain)"


async def load_and_faults(
    pools: PoolCluster,
    faults: PoolFaults,
    reqs: list[Any],
    schedule: Sequence[Fault],
    concurrency: int,
    deadline_s: float,
) -> list[StreamResult]:
    """The load with the faults: each fires once its share of the load is in flight (``Phases``)."""
    phases = Phases(schedule, len(reqs), concurrency)
    done = 0

    def on_done(_: StreamResult) -> None:
        nonlocal done
        done += 1
        if done % 50 == 0 or done == len(reqs):
            say(f"[chaos] {faults.now():6.1f} s  {done}/{len(reqs)} ended")

    async def nothing(_: Fault) -> None:
        return None

    load = asyncio.ensure_future(
        drive(
            pools.router_target,
            reqs,
            concurrency=concurrency,
            deadline_s=deadline_s,
            t0=faults.t0,
            on_done=on_done,
            admit=phases.admit,
        )
    )
    firing = asyncio.ensure_future(phases.fire(faults.apply, nothing))
    results = await load
    await firing
    return results


def table(doc: dict[str, Any]) -> str:
    held = doc["held_after_s10"]
    md, p, drain = doc.get("md_kill", {}), doc.get("p_kill", {}), doc.get("drain", {})

    def share(k: dict[str, Any], what: str) -> str:
        if not k:
            return "-"
        failed = k["failed_reasons"] or 0
        needed = k["in_flight"] - k.get("rld_alone", 0) - k.get("done_before_kill", 0)
        return f"{k['rescued_share']:.0%} of {needed} ({k['moved']} {what}; failed: {failed})"

    rows = [
        ("requests", doc["requests"]),
        ("finished", doc["finished"]),
        ("failed", doc["failed"]),
        ("hung (> deadline + 1 s)", doc["hung"]),
        ("failures without a reason", doc["untyped_failures"]),
        ("token mismatches", doc["token_mismatches"]),
        ("gaps / duplicates", f"{doc['gaps']} / {doc['duplicates']}"),
        (
            "held 10 s after (kv_blocks, leases, waiting)",
            f"{held['kv_blocks']}, {held['leases']}, {held['waiting']}",
        ),
        (f"MD killed ({md.get('instance', '-')}): in flight finished on another MD", share(md, "moved")),
        (
            "  of them RLD finished alone; the killed MD finished first; strict share",
            f"{md.get('rld_alone', 0)}; {md.get('done_before_kill', 0)}; {md.get('strict_share', 0):.0%}",
        ),
        (f"P killed ({p.get('instance', '-')}): in flight that finished", share(p, "moved to the other P")),
        (
            f"drain ({drain.get('instance', '-')}): failed / placed on it after the drain",
            f"{doc['drain_failed']} of {drain.get('in_flight', 0)} / {doc['drain_new_placed']}",
        ),
        ("rejoin after restart, s (up -> first placed)", json.dumps(doc["rejoin_by_instance_s"])),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [
        "",
        f"{'fault':<16}{'start s':>9}{'end s':>9}{'in flight':>11}{'finished':>10}  failures / note",
    ]
    for f in doc["faults"]:
        reasons = ", ".join(f"{k} x{n}" for k, n in f["failed_reasons"].items()) or "-"
        lines.append(
            f"{f['name']:<16}{f['start_s']:>9.1f}{f['end_s']:>9.1f}{f['in_flight']:>11}{f['finished']:>10}"
            f"  {reasons}; {f['note']}"
        )
    if doc["failure_reasons"]:
        lines += [
            "",
            "why requests did not finish: "
            + ", ".join(f"{k} x{n}" for k, n in doc["failure_reasons"].items()),
        ]
    return "\n".join(lines)


def main(
    *,
    topology_path: str,
    requests: int,
    concurrency: int,
    deadline_s: float,
    json_path: str | None,
    plot_path: str,
    seed: int,
    max_output: int,
) -> dict[str, Any]:
    topology = load_topology(Path(topology_path))
    work = Path(tempfile.mkdtemp(prefix="pddlink-chaos-pools-"))
    spec = PoolSpec(work / "run", topology, placement="prefix_aware", deadline_s=deadline_s, tls=True)
    schedule = pool_schedule(topology, deadline_s)
    reqs = workload(requests, seed, max_output)
    warm = workload(max(20, concurrency), seed + 1, max_output)
    say(f"chaos --topology {topology_path}: {len(reqs)} requests, {concurrency} at once, deadline "
        f"{deadline_s:g} s, faults: " + ", ".join(f.name for f in schedule))  # fmt: skip
    wan = LoopbackWan(topology, f"cp{os.getpid() % 100000}")
    try:
        with PoolCluster(spec, wan=wan) as pools:
            say(f"[chaos] pools up: {len(pools.members)} instances, one router, mutual TLS per instance")
            asyncio.run(drive(pools.router_target, warm, concurrency=concurrency, deadline_s=deadline_s,
                              t0=time.monotonic()))  # fmt: skip
            runner = PoolFaults(pools, time.monotonic(), deadline_s)
            results = asyncio.run(load_and_faults(pools, runner, reqs, schedule, concurrency, deadline_s))
            runner.rejoined()
            say(f"[chaos] load over; {QUIET_S:g} s of quiet, then what is still held")
            time.sleep(QUIET_S)
            held = held_now(pools)
            roles = {name: m.role.value for name, m in pools.members.items()}
    finally:
        wan.down()
    with open(work / "requests.jsonl", "w") as f:
        for r in results:
            row = {"index": r.index, "pipeline": r.pipeline, "start": r.started_s, "end": r.ended_s}
            row |= {"outcome": r.outcome, "reason": r.reason, "sources": r.sources, "trace": r.trace}
            f.write(json.dumps(row) + "\n")
    say("reference: one engine generating every request alone (separate process, float64)")
    try:
        reference = reference_tokens(
            [r for r, _ in reqs], ClusterSpec(work), work, timeout_s=REFERENCE_TIMEOUT_S
        )
    except subprocess.SubprocessError as exc:
        raise PddlinkError(f"the reference pass failed: {exc}") from None
    doc = evaluate(
        results, reference, [len(r.prompt) for r, _ in reqs], runner.records, deadline_s=deadline_s
    )
    doc |= pool_measures(results, runner.records, runner.rejoin_s, roles)
    doc["restart_to_ready_s"] = runner.restart_s
    doc["held_after_s10"] = held
    doc["setting"] = {
        "topology": topology_path,
        "concurrency": concurrency,
        "deadline_s": deadline_s,
        "max_output_tokens": max_output,
        "placement": spec.placement,
        "work_dir": str(work),
    }
    print(table(doc))
    timeline(results, runner.records, Path(plot_path))
    say(f"timeline: {plot_path}; logs: {work}")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    return doc
