"""The router's fleet: every instance of the topology (``pddlink.topology``) with its health, drain
and load, each MD's own DRC mirror (and each P's, where P publishes one), and one link model per
WAN link; ``place(prompt, now)`` turns them into the snapshots ``pddlink.routing.place`` takes (the
function the simulator runs) and answers a ``Route``: the P, MD and RLD one request goes to, the
MD's matched prefix and the link.

Health comes from outside (``usable(name)``: the backend's per-instance channel watch,
``router.role_health``); the fleet adds what only the router knows: instances an operator drained
(``drain``), instances that stalled or failed a request lately (``stalled``, ``failed``: a
``StallBreaker`` each, so a loss the channel watch has not seen yet still counts) and the
requests it placed on each instance (``begin``/``end``). An instance that leaves placement is
logged and counted (``pddlink_router_instance_out{instance,reason}``) once per loss; an MD that
left forgets what ``prefix_hash`` remembered of it (a restarted MD holds nothing).

Membership that changes at run time (``router.members``: etcd) comes in through ``add`` and
``remove``: an instance joins one of the topology's datacenters (the topology keeps the
datacenters and links; the file's own instances stay for good) and leaves placement at once when
it goes; what it was running ends on its own.

When no healthy MD (or P) is left the fleet still answers a route, marked ``md_usable=False``
(or to the P anyway): the router then takes the single-instance paths it always took (singular on
RLD while MD is out; P's Prefill waiting for P within its deadline), so a topology of one each
behaves exactly like the old three addresses. Sans-I/O: the clock comes in as ``now``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pddlink import metrics
from pddlink.errors import InvalidInput, NotFound
from pddlink.kv.hashing import BlockHasher
from pddlink.lifecycle import StallBreaker
from pddlink.roles import Role
from pddlink.routing import LinkModel
from pddlink.routing.books import PrefillBook
from pddlink.routing.placement import (
    FleetView,
    LinkView,
    MdSnapshot,
    Placement,
    PlacementConfig,
    PlacementMemory,
    PlacementPolicy,
    PlacementRequest,
    PSnapshot,
    RldSnapshot,
    choose_rld,
    place,
)
from pddlink.topology import Datacenter, Instance, Member, Topology

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 16  # until an MD's mirror has told its block size
PROMPT_EWMA = 0.1  # weight of one request in the mean prefill (tokens) this router sends


class MirrorView(Protocol):
    """One MD's DRC mirror as placement reads it (``router.mirror.MirrorFollower``)."""

    def matched_tokens(self, prompt: tuple[int, ...]) -> int: ...

    def blocks(self) -> int: ...

    def block_tokens(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes."""

    p: Member
    md: Member
    rld: Member | None  # the RLD beside P a relay would use (None: none usable there)
    matched_tokens: int  # the MD's matched prefix, from its own mirror
    link: LinkModel  # the WAN line from P's datacenter to MD's
    reason: str  # the placement's reason, or the refusal the route was made despite
    md_usable: bool = True  # False: no MD was usable (the router's MD-unavailable paths)


class Fleet:
    def __init__(
        self,
        topology: Topology,
        *,
        policy: PlacementPolicy,
        usable: Callable[[str], bool],
        mirrors: Mapping[str, MirrorView],
        kv_bytes_per_token: int,
        wan_links: int,
        p_prefill_tokens_per_s: float,
        p_mirrors: Mapping[str, MirrorView] | None = None,
    ) -> None:
        self.topology = topology
        self.members = {m.name: m for m in topology.members()}
        self.healthy = usable
        self.mirrors = dict(mirrors)  # MD's
        self.p_mirrors = dict(p_mirrors or {})  # P's own prefix caches (none known: P's match unknown)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.config = PlacementConfig(policy=policy)
        self.memory = PlacementMemory()
        self.links = {
            frozenset((k.a, k.b)): LinkModel(k.line_bytes_per_s, k.rtt_s, pool_size=wan_links)
            for k in topology.links
        }
        self.p_prefill_tokens_per_s = p_prefill_tokens_per_s
        self.p_books = {m.name: PrefillBook(p_prefill_tokens_per_s) for m in topology.members(Role.P)}
        self.stalls = {name: StallBreaker() for name in self.members}
        self.broke: dict[str, str] = {}  # why an instance's breaker last opened: stalled | failed
        self.running: Counter[str] = Counter()
        self.placed: Counter[str] = Counter()
        self.drained: set[str] = set()
        self.outs: Counter[str] = Counter()
        self._was_in: dict[str, bool] = {name: True for name in self.members}
        self.left: set[str] = set()  # instances that left the membership (``remove``)
        self.was_unreachable: set[str] = set()  # their channel was lost; not seen back yet
        self.probes: list[str] = []  # MDs back in placement that get the next request (``place``)
        self.router_name = ""  # this router's name: what starts the request keys it mints
        self.reported_pending: dict[str, frozenset[str]] = {}  # P -> the prefills it holds (its status)
        self.mean_prompt_tokens = 0.0
        self.turn = 0  # placements made: where the P and RLD lists start (ties go round)

    # -- what the router and the operator tell it ----------------------------------------------

    def member(self, name: str) -> Member:
        m = self.members.get(name)
        if m is None:
            raise NotFound(f"no instance {name!r} in the topology ({', '.join(self.members)})")
        return m

    def drain(self, name: str, now: float) -> None:
        """No new request goes to ``name``; those on it end normally."""
        self.member(name)
        self.drained.add(name)
        self.in_placement(name, now)

    def undrain(self, name: str, now: float) -> None:
        self.member(name)
        self.drained.discard(name)
        self.in_placement(name, now)

    def stalled(self, md: str, now: float, why: str = "stalled") -> None:
        """A run saw ``md``'s stream make no progress: new requests keep off it for a while."""
        self.stalls[md].stalled(now)
        self.broke[md] = why
        self.in_placement(md, now)

    def failed(self, name: str, now: float) -> None:
        """A request failed on ``name`` (its P unavailable, its MD lost): keep off it for a while,
        whether or not its channel says so yet."""
        self.stalled(name, now, "failed")

    def streamed(self, md: str) -> None:
        """``md`` streamed a request's tokens: it is healthy again."""
        self.stalls[md].healthy()

    def begin(self, route: Route, relayed: bool) -> None:
        for m in (route.p, route.md, route.rld if relayed else None):
            if m is not None:
                self.running[m.name] += 1
                self.placed[m.name] += 1
                metrics.PLACED.labels(role=m.role.value, instance=m.name).inc()

    def end(self, route: Route, relayed: bool) -> None:
        for m in (route.p, route.md, route.rld if relayed else None):
            if m is not None:
                self.running[m.name] = max(0, self.running[m.name] - 1)

    def shift(self, old: Member, new: Member) -> None:
        """A run moved from ``old`` to ``new`` (its instance of that role was lost)."""
        self.running[old.name] = max(0, self.running[old.name] - 1)
        self.running[new.name] += 1
        self.placed[new.name] += 1
        metrics.PLACED.labels(role=new.role.value, instance=new.name).inc()

    # -- membership that changes at run time ------------------------------------------------------

    def add(self, instance: Instance, datacenter: str, mirror: MirrorView | None = None) -> None:
        """``instance`` joins ``datacenter``'s pool of its role; ``InvalidInput`` when the topology
        would not hold it (an unknown datacenter, a duplicate name, identity or address, an MD
        datacenter with no link from P's)."""
        if instance.name in self.members:
            raise InvalidInput(f"instance {instance.name!r} is already in the topology")
        dcs = []
        for dc in self.topology.datacenters:
            if dc.name == datacenter:
                dc = _with_pool(dc, instance.role, (*dc.pool(instance.role), instance))
            dcs.append(dc)
        if all(dc.name != datacenter for dc in dcs):
            raise InvalidInput(f"instance {instance.name!r}: no datacenter {datacenter!r} in the topology")
        self.topology = Topology(tuple(dcs), self.topology.links)
        self._enter(Member(datacenter, instance), mirror)

    def remove(self, name: str, now: float) -> None:
        """``name`` leaves the topology and placement; nothing is sent there any more."""
        m = self.member(name)
        dcs = []
        for dc in self.topology.datacenters:
            pool = tuple(i for i in dc.pool(m.role) if i.name != name)
            dcs.append(_with_pool(dc, m.role, pool) if dc.name == m.datacenter else dc)
        self.topology = Topology(tuple(dcs), self.topology.links)
        if self._was_in.get(name):
            metrics.INSTANCE_OUT.labels(instance=name, reason="left").inc()
            log.warning("instance %s out of placement: left the membership", name)
        # its books stay: the runs still on it report back to them until they end
        self.left.add(name)
        self._was_in[name] = False
        del self.members[name]
        self.mirrors.pop(name, None)
        self.p_mirrors.pop(name, None)
        self.drained.discard(name)
        if m.role is Role.MD:
            self.memory.forget(name)

    def _enter(self, m: Member, mirror: MirrorView | None) -> None:
        self.members[m.name] = m
        if mirror is not None:
            (self.p_mirrors if m.role is Role.P else self.mirrors)[m.name] = mirror
        if m.role is Role.P:
            self.p_books[m.name] = PrefillBook(self.p_prefill_tokens_per_s)
        self.stalls[m.name] = StallBreaker()
        self.broke.pop(m.name, None)
        self.left.discard(m.name)
        self._was_in[m.name] = True
        log.warning("instance %s (%s in %s) joined placement", m.name, m.role.value, m.datacenter)

    # -- health ----------------------------------------------------------------------------------

    def why_out(self, name: str, now: float) -> str:
        """ "" when ``name`` may get new requests, else why not."""
        if name in self.left:
            return "left"
        if name in self.drained:
            return "drained"
        if not self.healthy(name):
            self.was_unreachable.add(name)
            return "unreachable"
        if name in self.was_unreachable:
            self.was_unreachable.discard(name)
            if len(self.topology.members(self.members[name].role)) > 1:
                # back after its channel was lost (a restart, most often): the stalls and failures
                # its runs reported of the old process are no reason to keep a pool's new one out
                # (reports of one death opened the breaker many times over: tens of seconds)
                self.stalls[name].healthy()
        if not self.stalls[name].usable(now):
            return self.broke.get(name, "stalled")
        return ""

    def in_placement(self, name: str, now: float) -> bool:
        """Whether ``name`` may get new requests; a change is logged and counted here, once."""
        why = self.why_out(name, now)
        was = self._was_in[name]
        if was and why:
            self.outs[name] += 1
            metrics.INSTANCE_OUT.labels(instance=name, reason=why).inc()
            log.warning("instance %s out of placement: %s", name, why)
            if self.members[name].role is Role.MD:
                self.memory.forget(name)  # a restarted MD holds nothing of what was sent there
        elif not was and not why:
            log.warning("instance %s back in placement", name)
            if self.members[name].role is Role.MD and name not in self.probes:
                self.probes.append(name)
        self._was_in[name] = not why
        return not why

    # -- placement -------------------------------------------------------------------------------

    def link(self, a: str, b: str) -> LinkModel | None:
        return self.links.get(frozenset((a, b))) if a != b else None

    def block_tokens(self) -> int:
        for mirror in self.mirrors.values():
            size = mirror.block_tokens()
            if size:
                return size
        return DEFAULT_BLOCK_TOKENS

    def spare(self, name: str, now: float, avoid: frozenset[str] = frozenset()) -> bool:
        """Another instance of ``name``'s role than ``name`` (and ``avoid``) may get requests now:
        a run that lost ``name`` can be re-placed within the role (``moved``)."""
        m = self.members.get(name)
        if m is None:
            return False
        others = (o for o in self.topology.members(m.role) if o.name != name and o.name not in avoid)
        return any(not self.why_out(o.name, now) for o in others)

    def moved(
        self, route: Route, role: Role, prompt: tuple[int, ...], now: float, avoid: frozenset[str]
    ) -> Route | None:
        """``route`` with its instance of ``role`` (P or MD) replaced: placement run again with
        ``avoid`` (the lost instance, and any a run lost before) out of it; the other roles
        stay where they are (an RLD that is not beside a new P is replaced too). None when no
        other instance is placeable."""
        placed = self.place(prompt, now, avoid=avoid)
        new = placed.md if role is Role.MD else placed.p
        if new.name in avoid or new.role is not role or not placed.md_usable:
            return None
        p, md = (route.p, new) if role is Role.MD else (new, route.md)
        rld = route.rld
        if role is Role.P and (rld is None or rld.datacenter != p.datacenter):
            rld = placed.rld
        matched = {md.name: placed.matched_tokens} if md.name == placed.md.name else {}
        return self._route(p.name, md.name, rld.name if rld else None, matched, route.reason, True)

    def place(self, prompt: tuple[int, ...], now: float, avoid: frozenset[str] = frozenset()) -> Route:
        """Where a request goes; ``avoid``: instances it must not use (a run re-placed after it
        lost one), as if unhealthy."""
        block = self.block_tokens()
        matched = {name: min(m.matched_tokens(prompt), len(prompt)) for name, m in self.mirrors.items()}
        # P's matches count only when every P's mirror is synced: an estimate that knew one P's cache
        # and guessed another's (P taken to lack what MD lacks) would favour the guess
        p_held = (
            {name: min(m.matched_tokens(prompt), len(prompt)) // block for name, m in self.p_mirrors.items()}
            if self.p_mirrors and all(m.block_tokens() is not None for m in self.p_mirrors.values())
            else {}
        )
        hashes = BlockHasher("router-placement", block).hash_blocks(list(prompt))
        request = PlacementRequest(len(prompt), block, self.kv_bytes_per_token, tuple(hashes))
        fleet = self.view(matched, block, now, p_held)
        if avoid:
            fleet = _without(fleet, avoid)
        placed = place(request, fleet, self.config, self.memory)
        reason = placed.reason.value
        if isinstance(placed, Placement) and self.probes:
            placed, reason = self._probe(request, fleet, placed, now)
        if isinstance(placed, Placement):
            missing = len(prompt) - matched.get(placed.md, 0)
            self.mean_prompt_tokens += PROMPT_EWMA * (missing - self.mean_prompt_tokens)
            return self._route(placed.p, placed.md, placed.rld, matched, reason, True)
        # none usable: the router's single-instance paths decide (see the module docstring)
        p = next((s.name for s in fleet.p if s.healthy and not s.draining), fleet.p[0].name)
        md_in = [s.name for s in fleet.md if s.healthy and not s.draining]
        md = md_in[0] if md_in else fleet.md[0].name
        rld = choose_rld(fleet.rld, self.members[p].datacenter)
        return self._route(p, md, rld, matched, placed.reason.value, bool(md_in))

    def _probe(
        self, request: PlacementRequest, fleet: FleetView, placed: Placement, now: float
    ) -> tuple[Placement, str]:
        """An MD back in placement (a restart, an undrain, a breaker's cool-down over) gets the next
        request, once: a circuit breaker's half-open probe. Its DRC mirror is empty, so a
        prefix-aware placement would leave it idle for as long as the others hold the common
        prefixes and are not overloaded (chaos: a restarted MD got nothing in 13 s of load); one
        request proves its data path (P's WAN pool to it, the KV import) and starts its cache."""
        name = self.probes.pop(0)
        if name == placed.md or name not in self.members or self.why_out(name, now):
            return placed, placed.reason.value
        others = frozenset(s.name for s in fleet.md if s.name != name)
        probe = place(request, _without(fleet, others), self.config, self.memory)
        if not isinstance(probe, Placement):
            return placed, placed.reason.value
        return probe, "rejoin_probe"

    def others_queued_tokens(self, p: str) -> float:
        """Tokens other routers have queued at ``p``: the prefills P reports holding (its status,
        polled) that this router did not send, each counted as this router's mean prefill. With one
        router: 0 (every request P holds is its own, and its own book counts them exactly)."""
        mine = self.router_name + "-"
        others = sum(1 for rid in self.reported_pending.get(p, ()) if not rid.startswith(mine))
        return others * self.mean_prompt_tokens

    def view(
        self, matched: Mapping[str, int], block: int, now: float, p_held: Mapping[str, int] | None = None
    ) -> FleetView:
        """The snapshots placement reads, as this router sees the fleet now (``p_held``: blocks of
        the prompt each P's own cache holds, where its mirror is synced)."""
        p_held = p_held or {}
        ps, rlds, mds = [], [], []
        self.turn += 1  # ties between P (and RLD) instances go round: see ``_turned``
        for m in _turned(self.topology.members(Role.P), self.turn):
            book = self.p_books[m.name]
            ok = self.in_placement(m.name, now)
            queue_s = book.queue_s() + self.others_queued_tokens(m.name) / book.tokens_per_s
            held = p_held.get(m.name)
            ps.append(
                PSnapshot(m.name, m.datacenter, queue_s, book.tokens_per_s, healthy=ok, matched_blocks=held)
            )
        for m in _turned(self.topology.members(Role.RLD), self.turn):
            ok = self.in_placement(m.name, now)
            rlds.append(RldSnapshot(m.name, m.datacenter, self.running[m.name], healthy=ok))
        for m in self.topology.members(Role.MD):
            ok = self.in_placement(m.name, now)
            blocks = matched.get(m.name, 0) // block
            mds.append(MdSnapshot(m.name, m.datacenter, blocks, self.running[m.name], healthy=ok))
        links = tuple(
            LinkView(k.a, k.b, self.links[frozenset((k.a, k.b))].estimate(now)) for k in self.topology.links
        )
        return FleetView(tuple(ps), tuple(mds), tuple(rlds), links)

    def route_of(self, p: str, md: str, rld: str | None, reason: str = "given") -> Route:
        """The route through the named instances, as given (no placement; nothing matched)."""
        return self._route(p, md, rld, {}, reason, True)

    def _route(
        self, p: str, md: str, rld: str | None, matched: Mapping[str, int], reason: str, md_usable: bool
    ) -> Route:
        pm, mm = self.members[p], self.members[md]
        link = self.link(pm.datacenter, mm.datacenter)
        if link is None:  # P and MD in one datacenter: no WAN between them; a line as fast as RLD's
            link = LinkModel(1e9, 0.0005)
        return Route(pm, mm, self.members[rld] if rld else None, matched.get(md, 0), link, reason, md_usable)

    def relay_usable(self, route: Route, now: float) -> bool:
        return route.rld is not None and self.in_placement(route.rld.name, now)

    # -- what /status shows ------------------------------------------------------------------------

    def status(self, now: float, health: Mapping[str, Any]) -> dict[str, Any]:
        dcs = []
        for dc in self.topology.datacenters:
            pools: dict[str, Any] = {}
            for role in (Role.P, Role.RLD, Role.MD):
                pools[role.value] = [self._instance(m.name, now, health) for m in dc.pool(role)]
            dcs.append({"name": dc.name, **pools})
        links = [
            {
                "between": [k.a, k.b],
                "line_mbit": k.line_mbit,
                "rtt_ms": k.rtt_ms,
                "flows_in_flight": self.links[frozenset((k.a, k.b))].estimate(now).flows_in_flight,
                "backlog_bytes": self.links[frozenset((k.a, k.b))].estimate(now).backlog_bytes,
            }
            for k in self.topology.links
        ]
        return {"placement": self.config.policy.value, "datacenters": dcs, "links": links}

    def _instance(self, name: str, now: float, health: Mapping[str, Any]) -> dict[str, Any]:
        why = self.why_out(name, now)
        inst = self.members[name].instance
        out: dict[str, Any] = {
            "name": name,
            "address": inst.address,
            "in_placement": not why,
            "out_because": why or None,
            "draining": name in self.drained,
            "running": self.running[name],
            "placed": self.placed[name],
            "outs": self.outs[name],
            "health": health.get(name),
        }
        if inst.api_url:
            out["api_url"] = inst.api_url
        mirror = self.mirrors.get(name) or self.p_mirrors.get(name)
        if mirror is not None:
            out["mirror_blocks"] = mirror.blocks()
        out["breaks"] = self.stalls[name].stalls  # stalled or failed a request
        return out


def _without(fleet: FleetView, avoid: frozenset[str]) -> FleetView:
    """``fleet`` with the instances in ``avoid`` marked unhealthy (never chosen)."""
    return dataclasses.replace(
        fleet,
        p=tuple(dataclasses.replace(s, healthy=False) if s.name in avoid else s for s in fleet.p),
        md=tuple(dataclasses.replace(s, healthy=False) if s.name in avoid else s for s in fleet.md),
        rld=tuple(dataclasses.replace(s, healthy=False) if s.name in avoid else s for s in fleet.rld),
    )


def _with_pool(dc: Datacenter, role: Role, pool: tuple[Instance, ...]) -> Datacenter:
    if role is Role.P:
        return dataclasses.replace(dc, p=pool)
    if role is Role.RLD:
        return dataclasses.replace(dc, rld=pool)
    return dataclasses.replace(dc, md=pool)


def _turned(members: tuple[Member, ...], turn: int) -> tuple[Member, ...]:
    """``members`` starting at ``turn``: placement takes the first of equals, so ties between
    instances that look alike (idle, or load this router cannot see: another router's) go round
    instead of all to the first; MDs keep their order (ties there follow the cache)."""
    if not members:
        return members
    k = turn % len(members)
    return members[k:] + members[:k]
