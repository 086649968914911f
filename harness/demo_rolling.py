"""``pddlink demo --topology F --routers N --rolling-restart`` and ``--etcd-outage-s S``: a fleet
that does not stop, measured from a client behind HAProxy.

One deployment of the topology (``harness.pool_cluster``: a reference-engine sidecar per instance,
N routers, mutual TLS, a loopback WAN per link), membership through a real etcd of its own
(``harness.etcd_server``: every sidecar announces itself, every router follows), HAProxy in front
of the routers (``harness.lb``). After the warm-up, under a steady open-loop load of the pools
demo's workload (``--rate``):

- ``--rolling-restart``: every process, routers first, then P, RLD and MD sidecars, one at a time:
  SIGTERM, wait for it to exit, start it again on its ports, wait until it serves
  (``harness.rolling``); the load runs from before the first restart until after the last.
- ``--etcd-outage-s S``: an MD that only etcd knows joins first (so the last membership holds
  something the topology file does not); then the same load twice, each ``S + 20`` s long: once
  with etcd up (``baseline``), once with etcd stopped ``S`` s from 10 s in (``outage``). The
  routers' ``/status`` is read during the outage (``membership.stale``) and until they are fresh
  again.

Every finished request's tokens are checked against one engine generating it alone. Figures:
failed (typed, with reasons), hung, token mismatches, per restart what/when/how long until
serving/in flight/finished/failed; a PNG timeline per scenario (``--plot``, default next to
``--json``). JSON: ``{"rolling_restart": {...}, "etcd_outage": {...}, ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.cluster import ClusterError
from harness.demo import reference_tokens, say
from harness.demo_load import RequestResult
from harness.demo_pools import VOCAB, LoopbackWan
from harness.demo_workload import DemoRequest, build_trace, demo_requests
from harness.etcd_server import EtcdServer, etcd_binary
from harness.http_replay import replay_http
from harness.lb import HaProxy, haproxy_binary
from harness.pool_cluster import PoolCluster, PoolSpec
from harness.rolling import (
    Restarter,
    RestartStep,
    Timed,
    in_placement,
    restart_order,
    router_status,
    timed,
)
from harness.rolling_report import outage_doc, rolling_doc, table_outage, table_rolling
from pddlink.roles import Role
from pddlink.topology import Topology

LEAD_S = 8.0  # steady load before the first restart
GAP_S = 2.0  # between one process serving again and the next SIGTERM
TAIL_S = 8.0  # load after the last process serves again
ROLLING_BUDGET_S = 600.0  # requests generated for at most this long a rolling restart
OUTAGE_MARGIN_S = 10.0  # load before and after etcd's outage
JOINED_MD = "md-joined0"  # the MD only etcd knows (``--etcd-outage-s``)


class Load:
    """A steady load through the load balancer, each request on one clock (``origin``)."""

    def __init__(self, url: str, deadline_s: float, origin: float) -> None:
        self.url, self.deadline_s, self.origin = url, deadline_s, origin
        self.sent: dict[int, float] = {}
        self.done: list[RequestResult] = []
        self.stop = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.origin

    async def run(self, reqs: list[DemoRequest], label: str) -> list[Timed]:
        progress = asyncio.create_task(self._progress(label))
        try:
            results = await replay_http(
                self.url,
                reqs,
                deadline_s=self.deadline_s,
                on_sent=lambda r: self.sent.__setitem__(r.index, self.now()),
                on_done=self.done.append,
                until=self.stop.is_set,
            )
        finally:
            progress.cancel()
        return [timed(r, self.sent[r.index], self.deadline_s) for r in results]

    async def _progress(self, label: str) -> None:
        while True:
            await asyncio.sleep(10.0)
            failed = sum(r.outcome != "finished" for r in self.done)
            say(
                f"[{label}] {self.now():.0f} s: {len(self.sent)} sent, "
                f"{len(self.done)} ended, {failed} failed"
            )


def rolling(
    pools: PoolCluster, lb: HaProxy, reqs: list[DemoRequest], deadline_s: float
) -> tuple[list[Timed], list[RestartStep]]:
    """The rolling restart under load: the load's requests and the steps."""
    load = Load(lb.url, deadline_s, time.monotonic())
    restarter = Restarter(pools, lb, load.origin, exit_bound_s=deadline_s + 15.0, say=say)
    steps: list[RestartStep] = []

    async def go() -> list[Timed]:
        task = asyncio.create_task(load.run(reqs, "rolling"))
        try:
            await asyncio.sleep(LEAD_S)
            for name in restart_order(pools):
                steps.append(await asyncio.to_thread(restarter.restart, name))
                await asyncio.sleep(GAP_S)
            await asyncio.sleep(TAIL_S)
        finally:
            load.stop.set()
        return await task

    return asyncio.run(go()), steps


def _stale(pools: PoolCluster) -> dict[str, bool | None]:
    """Each router's ``membership.stale`` (None: it did not answer)."""
    out: dict[str, bool | None] = {}
    for process in pools.router_names:
        st = router_status(pools, process)
        out[process] = None if st is None else bool(st.get("membership", {}).get("stale"))
    return out


def _outage(pools: PoolCluster, etcd: EtcdServer, load: Load, outage_s: float, facts: dict[str, Any]) -> None:
    """etcd stopped ``outage_s`` from ``OUTAGE_MARGIN_S`` into the load; what the routers said."""
    time.sleep(OUTAGE_MARGIN_S)
    facts["down_s"] = round(load.now(), 2)
    etcd.stop()
    say(f"[outage] etcd stopped at {facts['down_s']:.1f} s, for {outage_s:.0f} s")
    seen: dict[str, list[bool | None]] = {p: [] for p in pools.router_names}
    until = time.monotonic() + outage_s
    while time.monotonic() < until:
        for process, stale in _stale(pools).items():
            seen[process].append(stale)
        time.sleep(1.0)
    facts["stale_seen"] = {p: sum(bool(x) for x in xs) / max(len(xs), 1) for p, xs in seen.items()}
    facts["in_placement_during"] = {
        p: in_placement(router_status(pools, p) or {}) for p in pools.router_names
    }
    facts["up_s"] = round(load.now(), 2)
    etcd.start()
    t0 = time.monotonic()
    facts["fresh_after_s"] = None
    while time.monotonic() - t0 < 30.0:
        if not any(v is not False for v in _stale(pools).values()):
            facts["fresh_after_s"] = round(time.monotonic() - t0, 2)
            break
        time.sleep(0.2)
    say(f"[outage] etcd back at {facts['up_s']:.1f} s; every router fresh after {facts['fresh_after_s']} s")


def etcd_outage(
    pools: PoolCluster,
    lb: HaProxy,
    etcd: EtcdServer,
    phases: tuple[list[DemoRequest], list[DemoRequest]],
    outage_s: float,
    deadline_s: float,
) -> tuple[list[Timed], list[Timed], dict[str, Any]]:
    """The same load twice, the second time with etcd stopped for ``outage_s``."""
    say("[outage] baseline: the load with etcd up")
    baseline = asyncio.run(Load(lb.url, deadline_s, time.monotonic()).run(phases[0], "baseline"))
    say("[outage] the same load, etcd stopped in the middle")
    load = Load(lb.url, deadline_s, time.monotonic())
    facts: dict[str, Any] = {}

    async def go() -> list[Timed]:
        got, _ = await asyncio.gather(
            load.run(phases[1], "outage"), asyncio.to_thread(_outage, pools, etcd, load, outage_s, facts)
        )
        return got

    return baseline, asyncio.run(go()), facts


def phases_of(every: list[DemoRequest], sizes: tuple[int, ...]) -> list[list[DemoRequest]]:
    """Consecutive slices of ``every`` (one workload: indexes stay unique across them, what the
    reference check goes by), each slice's arrivals from 0."""
    out, a = [], 0
    for n in sizes:
        part = every[a : a + n]
        t0 = part[0].arrival_s if part else 0.0
        out.append([replace(r, arrival_s=r.arrival_s - t0) for r in part])
        a += n
    return out


def _join_md(pools: PoolCluster, topology: Topology) -> None:
    """An MD the topology file does not name announces itself; every router must place on it."""
    dc = topology.members(Role.MD)[0].datacenter
    pools.add_sidecar(JOINED_MD, Role.MD, dc)
    until = time.monotonic() + 30.0
    while time.monotonic() < until:
        views = [in_placement(router_status(pools, p) or {}) for p in pools.router_names]
        if all(v.get(JOINED_MD) for v in views):
            say(f"[outage] {JOINED_MD} joined {dc} through etcd; every router places on it")
            return
        time.sleep(0.2)
    raise ClusterError(f"{JOINED_MD} not in every router's placement 30 s after its start")


@dataclass(frozen=True, slots=True)
class Scenario:
    """What to run: ``rolling_restart``, ``etcd_outage_s`` (0: not), over ``routers`` routers."""

    routers: int
    rolling_restart: bool
    etcd_outage_s: float
    rate_rps: float
    deadline_s: float = 30.0

    def sizes(self, warmup: int) -> tuple[int, int, int, int]:
        """Requests generated per phase: warm-up, rolling (as many as its longest run takes),
        baseline, outage."""
        roll = int(self.rate_rps * ROLLING_BUDGET_S) if self.rolling_restart else 0
        phase = int(self.rate_rps * (self.etcd_outage_s + 2 * OUTAGE_MARGIN_S)) if self.etcd_outage_s else 0
        return warmup, roll, phase, phase


def run_deployment(
    topology: Topology, sc: Scenario, work: Path, placement: str, phases: list[list[DemoRequest]]
) -> tuple[dict[str, list[Timed]], dict[str, Any]]:
    """One deployment behind HAProxy with etcd membership; the scenarios in turn."""
    warm, roll, base, outage = phases
    loads: dict[str, list[Timed]] = {}
    facts: dict[str, Any] = {}
    with EtcdServer(work / "etcd") as etcd:
        wan = LoopbackWan(topology, f"rr{os.getpid() % 100000}")
        spec = PoolSpec(work / "fleet", topology, placement=placement, routers=sc.routers,
                        etcd=etcd.endpoint, deadline_s=sc.deadline_s)  # fmt: skip
        try:
            with PoolCluster(spec, wan) as pools:
                names = pools.router_names
                servers = [(pools.router_identity(n), "127.0.0.1", pools.router_ports[n][1]) for n in names]
                with HaProxy.up(work / "lb", servers) as lb:
                    say(f"up: {len(pools.procs)} processes, etcd {etcd.endpoint}, client -> haproxy {lb.url}")
                    if warm:
                        paced = [replace(r, arrival_s=0.4 * i) for i, r in enumerate(warm)]
                        w = asyncio.run(replay_http(lb.url, paced, deadline_s=sc.deadline_s, pipeline="p_md"))
                        say(f"warm-up: {len(w)} requests ({sum(r.outcome != 'finished' for r in w)} failed)")
                    if sc.rolling_restart:
                        loads["rolling"], facts["steps"] = rolling(pools, lb, roll, sc.deadline_s)
                    if sc.etcd_outage_s:
                        _join_md(pools, topology)
                        loads["baseline"], loads["outage"], facts["outage"] = etcd_outage(
                            pools, lb, etcd, (base, outage), sc.etcd_outage_s, sc.deadline_s
                        )
        finally:
            wan.down()
    return loads, facts


def main(
    *,
    topology: Topology,
    topology_path: str,
    scenario: Scenario,
    workload: str | None,
    json_path: str | None,
    plot_path: str | None,
    seed: int,
    warmup: int,
    placement: str = "prefix_aware",
) -> dict[str, Any]:
    haproxy_binary()  # before anything starts: what is missing is one clear line
    etcd_binary()
    sc = scenario
    work = Path(tempfile.mkdtemp(prefix="pddlink-rolling-"))
    sizes = sc.sizes(warmup)
    trace = build_trace(
        requests=sum(sizes), rate_rps=sc.rate_rps, seed=seed, workload=workload, trace_file=None
    )
    every = demo_requests(trace, vocab_size=VOCAB)
    say(
        f"topology {topology_path}: {len(topology.members())} sidecars, {sc.routers} routers behind haproxy, "
        f"membership through etcd; load {sc.rate_rps} requests/s; placement {placement}"
    )
    loads, facts = run_deployment(topology, sc, work, placement, phases_of(every, sizes))
    sent = sorted({t.index for ts in loads.values() for t in ts})
    say(f"reference: {len(sent)} requests, one engine generating each alone (separate process, float64)")
    from harness.cluster import ClusterSpec

    tokens = reference_tokens([every[i] for i in sent], ClusterSpec(work), work, timeout_s=1800.0)
    reference = dict(zip(sent, tokens, strict=True))
    png = Path(plot_path) if plot_path else default_plot(json_path)
    doc: dict[str, Any] = {"topology": topology_path, "routers": sc.routers, "placement": placement}
    if "rolling" in loads:
        doc["rolling_restart"] = rolling_doc(loads["rolling"], facts["steps"], reference, png)
        print(table_rolling(doc["rolling_restart"]))
    if "outage" in loads:
        out_png = png.with_name(png.stem + "-etcd-outage.png")
        doc["etcd_outage"] = outage_doc(
            loads["baseline"],
            loads["outage"],
            facts["outage"],
            sc.etcd_outage_s,
            reference,
            out_png,
            JOINED_MD,
        )
        print(table_outage(doc["etcd_outage"]))
    doc["setting"] = {"rate_rps": sc.rate_rps, "seed": seed, "warmup": warmup, "deadline_s": sc.deadline_s,
                      "lab_mode": "loopback", "load_balancer": "haproxy", "membership": "etcd",
                      "work_dir": str(work)}  # fmt: skip
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    say(f"logs: {work}")
    sys.stdout.flush()
    return doc


def default_plot(json_path: str | None) -> Path:
    return Path(json_path).with_suffix(".png") if json_path else Path("out") / "pddlink-demo-rolling.png"
