"""A rolling restart of a running deployment (``harness.pool_cluster.PoolCluster`` behind
``harness.lb.HaProxy``), one process at a time, as an operator's script does it:

    restarter = Restarter(pools, lb, origin=time.monotonic())
    for name in restart_order(pools):
        step = restarter.restart(name)    # SIGTERM, wait for the exit, start again, wait until serving

Each step sends SIGTERM (a router stops accepting and finishes its streams; a sidecar announces
``draining`` through etcd and lets what it holds end), waits for the exit (within ``exit_bound_s``,
else SIGKILL, recorded), starts the process again with its own file on its own ports, and waits
until it serves again: a router when HAProxy's health check has it ``UP``; a sidecar when every
router has it back in placement (``/status``). The times go into a ``RestartStep``.

``Timed`` is one request of the load as the client saw it (sent, ended, outcome, reason, where the
router placed it); ``step_figures`` says, per step, what was in flight at SIGTERM and what ran
during the restart, finished or failed with its reasons.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.cluster import ClusterError
from harness.demo_load import RequestResult
from harness.lb import HaProxy
from harness.pool_cluster import PoolCluster
from pddlink.roles import Role

SERVING_TIMEOUT_S = 90.0  # a process not serving again this long after its start fails the run
POLL_S = 0.2
HUNG_AFTER_S = 5.0  # past its deadline with no terminal state: hung


@dataclass(frozen=True, slots=True)
class RestartStep:
    process: str  # the process name (``router``, ``router1``, ``p-a0``, ...)
    role: str  # router | p | rld | md
    term_s: float  # SIGTERM sent (seconds since the load's start)
    exit_s: float  # the process exited (or was killed)
    exit_code: int | None  # None: still there after the bound, killed
    ready_s: float  # started again: its READY line
    serving_s: float  # serving again (HAProxy UP / back in every router's placement)

    @property
    def down_s(self) -> float:
        """SIGTERM until serving again."""
        return self.serving_s - self.term_s


@dataclass(slots=True)
class Timed:
    """One request of the load, on the load's clock (seconds since its start)."""

    index: int
    sent_s: float
    ended_s: float
    outcome: str
    reason: str
    hung: bool
    where: dict[str, str] = field(default_factory=dict)  # router, p, md, rld: what served it
    tokens: tuple[int, ...] = ()  # a finished request's tokens (checked against the reference)

    def overlaps(self, a: float, b: float) -> bool:
        return self.sent_s < b and self.ended_s > a


def timed(res: RequestResult, sent_s: float, deadline_s: float) -> Timed:
    placement = res.trace.get("placement") or {}
    where = {k: str(placement[k]) for k in ("p", "md", "rld") if placement.get(k)}
    key = str(res.trace.get("request_key", ""))
    if key:
        where["router"] = key.rsplit("-", 1)[0]
    hung = res.outcome != "finished" and (
        res.e2e_s > deadline_s + HUNG_AFTER_S or "Timeout" in res.reason.split(":", 1)[0]
    )
    tokens = tuple(res.tokens) if res.outcome == "finished" else ()
    return Timed(res.index, sent_s, sent_s + res.e2e_s, res.outcome, res.reason, hung, where, tokens)


def restart_order(pools: PoolCluster) -> list[str]:
    """Every process of the deployment: the routers, then P, RLD and MD sidecars."""
    by_role = {r: [n for n, m in pools.members.items() if m.role is r] for r in (Role.P, Role.RLD, Role.MD)}
    return [*pools.router_names, *by_role[Role.P], *by_role[Role.RLD], *by_role[Role.MD]]


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc
    except (urllib.error.URLError, OSError, ValueError):
        return None


def router_status(pools: PoolCluster, process: str) -> dict[str, Any] | None:
    return _get_json(pools.router_url(process) + "/status")


def in_placement(status: dict[str, Any]) -> dict[str, bool]:
    """Instance name -> in placement, from a router's ``/status``."""
    dcs = status.get("topology", {}).get("datacenters", [])
    return {
        i["name"]: bool(i["in_placement"]) for dc in dcs for r in ("p", "rld", "md") for i in dc.get(r, [])
    }


class Restarter:
    def __init__(
        self,
        pools: PoolCluster,
        lb: HaProxy,
        origin: float,
        exit_bound_s: float,
        say: Callable[[str], None] = lambda s: None,
    ) -> None:
        self.pools, self.lb, self.origin, self.say = pools, lb, origin, say
        self.exit_bound_s = exit_bound_s

    def now(self) -> float:
        return time.monotonic() - self.origin

    def role(self, name: str) -> str:
        return "router" if name in self.pools.router_names else self.pools.members[name].role.value

    def serving(self, name: str) -> bool:
        if name in self.pools.router_names:
            return self.lb.states().get(self.pools.router_identity(name)) == "UP"
        for process in self.pools.router_names:
            status = router_status(self.pools, process)
            if status is None or not in_placement(status).get(name, False):
                return False
        return True

    def restart(self, name: str) -> RestartStep:
        role = self.role(name)
        term_s = self.now()
        self.say(f"restart {name} ({role}): SIGTERM at {term_s:.1f} s")
        code = self.pools.terminate(name, self.exit_bound_s)
        exit_s = self.now()
        how = f"exit {code}" if code is not None else f"killed after {self.exit_bound_s:.0f} s"
        self.say(f"restart {name}: {how} after {exit_s - term_s:.1f} s; starting again")
        self.pools.start_again(name)
        ready_s = self.now()
        until = time.monotonic() + SERVING_TIMEOUT_S
        while not self.serving(name):
            if time.monotonic() > until:
                raise ClusterError(f"{name} not serving {SERVING_TIMEOUT_S:.0f} s after its start")
            time.sleep(POLL_S)
        step = RestartStep(name, role, term_s, exit_s, code, ready_s, self.now())
        self.say(f"restart {name}: serving again {step.down_s:.1f} s after SIGTERM")
        return step


def step_figures(step: RestartStep, load: list[Timed]) -> dict[str, Any]:
    """What the load saw of one restart: in flight at SIGTERM (and of those, on this process),
    and every request that ran between SIGTERM and serving again, finished or failed."""
    at_term = [t for t in load if t.sent_s <= step.term_s < t.ended_s]
    on_it = [t for t in at_term if step.process in t.where.values() or _router_of(step, t)]
    during = [t for t in load if t.overlaps(step.term_s, step.serving_s)]
    failed = [t for t in during if t.outcome != "finished"]
    return {
        **asdict(step),
        "down_s": round(step.down_s, 3),
        "in_flight_at_term": len(at_term),
        "in_flight_on_it": len(on_it),
        "in_flight_on_it_finished": sum(t.outcome == "finished" for t in on_it),
        "during": len(during),
        "finished": len(during) - len(failed),
        "failed": len(failed),
        "failure_reasons": dict(Counter(t.reason[:120] for t in failed)),
    }


def _router_of(step: RestartStep, t: Timed) -> bool:
    ident = "router0" if step.process == "router" else step.process
    return step.role == "router" and t.where.get("router") == ident


def load_figures(load: list[Timed], mismatches: int) -> dict[str, Any]:
    failed = [t for t in load if t.outcome != "finished"]
    n = len(load)
    return {
        "requests": n,
        "finished": n - len(failed),
        "failed": len(failed),
        "failed_share": round(len(failed) / n, 4) if n else 0.0,
        "hung": sum(t.hung for t in load),
        "token_mismatches": mismatches,
        "failure_reasons": dict(Counter(t.reason[:120] for t in failed).most_common(10)),
        "served_by_router": dict(
            Counter(t.where.get("router", "?") for t in load if t.outcome == "finished")
        ),
    }
