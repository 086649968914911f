"""Placement: which P, which MD (in whichever datacenter) and which RLD serve one request.

``place(request, fleet, config, memory) -> Placement | PlacementRefusal`` is called once per request
by the router and by the simulator, so both place alike. Inputs are snapshots the caller observed:
per P its queue (seconds of work ahead) and prefill speed; per MD the prefix blocks its own DRC
mirror holds of this prompt, its running and waiting requests, KV pool use and step time; per RLD
its load; per WAN link a ``LinkEstimate`` with its backlog. Health and drain come with each
snapshot: an unhealthy or draining instance is never chosen; a role with none left is a typed
``PlacementRefusal`` (an RLD is optional: ``Placement.rld`` is None and the request cannot relay).

Policies (``PlacementPolicy``) choose the MD; P then goes to the one that reaches it first (its
datacenter's least-queued P; with ``prefix_aware``, whichever P of any datacenter gives the least
estimated TTFT, its own prefix cache counted when its mirror is known) and RLD to the least loaded
beside that P, in every policy:

- ``prefix_aware`` (default): the least estimated TTFT over every (MD, P) pair, ``P queue + P
  prefill of what P lacks (``PSnapshot.matched_blocks``; unknown: what MD lacks) + WAN time of the
  suffix MD lacks over this MD's link with its backlog + MD wait``, as Dynamo's KV router scores
  prefill workers by their overlap: a P that holds the prompt prefills a few tokens where another
  prefills it all (the simulator's pools demo: TTFT P50 0.107 -> 0.091 s, P90 0.291 -> 0.216 s,
  2026-12-05); MD wait is
  ``md_wait_s_per_waiting`` per waiting request (0 by default: the balance limits below do the
  load's work, as the calibrated simulator runs them). Ties go to the least loaded MD; ties in load
  too rotate (with a ``PlacementMemory``; else the first). Without the rotation a new prefix (no MD
  holds more of it than another behind the same line) went to the first MD listed whenever the
  loads this router counts were equal: with two routers, each counting only its own requests, that
  was most of the time, and a session's later turns follow its prefix (``pddlink demo --routers 2``:
  143 of 200 requests on md-b0 and 2 on md-c1, against 100 and 16 with one router).
- ``least_loaded``: the MD with the fewest running + waiting requests; ties rotate (with a
  ``PlacementMemory``; else the first), so an idle fleet is not one MD.
- ``round_robin``: the next MD in turn (the cursor lives in ``PlacementMemory``).
- ``prefix_hash``: the approximate mode of llm-d and SGLang: no events; this router remembers to
  which MD it sent each block hash (``PlacementMemory``, bounded LRU) and sends a prompt to the MD
  it sent the deepest remembered block to, else to the least loaded (ties rotate).
- ``oracle`` (simulator only): the MD whose cache truly holds the most (``exact_matched_blocks``),
  ignoring balance; ties by estimated TTFT then load. An upper bound on the hit rate.

Balance limits (all but ``round_robin`` and ``oracle``): an MD whose admission queue is more than
``balance_queue`` longer than the shortest, whose step time reached ``balance_tpot_s``, or whose
KV pool use reached ``md_kv_use_max`` is passed over unless every one is. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from pddlink.errors import ConfigError, InvalidInput
from pddlink.routing.link import LinkEstimate


class PlacementPolicy(StrEnum):
    PREFIX_AWARE = "prefix_aware"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_HASH = "prefix_hash"
    ORACLE = "oracle"


class PlacementReason(StrEnum):
    BEST_TTFT = "best_ttft"  # prefix_aware
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    REMEMBERED_PREFIX = "remembered_prefix"  # prefix_hash: sent where this prefix went before
    NEW_PREFIX = "new_prefix"  # prefix_hash: nothing remembered (or that MD is out): least loaded
    EXACT_CACHE = "exact_cache"  # oracle


class RefusalReason(StrEnum):
    NO_P = "no_healthy_p"
    NO_MD = "no_healthy_md"
    NO_ROUTE = "no_link_to_any_md"  # healthy MDs exist, but no healthy P's datacenter reaches one


@dataclass(frozen=True, slots=True)
class PSnapshot:
    name: str
    datacenter: str
    queue_s: float = 0.0  # work ahead of a new prompt
    prefill_tokens_per_s: float | None = None  # None: prefill time left out of the estimate
    healthy: bool = True
    draining: bool = False
    # of this prompt, in this P's own prefix cache (its DRC mirror); None: unknown, and P is taken
    # to prefill what the MD lacks
    matched_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class RldSnapshot:
    name: str
    datacenter: str
    running_requests: int = 0
    healthy: bool = True
    draining: bool = False


@dataclass(frozen=True, slots=True)
class MdSnapshot:
    name: str
    datacenter: str
    matched_blocks: int  # of this prompt, in this MD's own mirror
    running_requests: int = 0
    waiting_requests: int = 0  # admitted but waiting for a batch slot or KV room
    kv_use_fraction: float = 0.0
    step_s: float = 0.0  # its decode iteration time now (0: unknown)
    healthy: bool = True
    draining: bool = False
    exact_matched_blocks: int | None = None  # what its cache truly holds (simulator: oracle)

    @property
    def load(self) -> int:
        return self.running_requests + self.waiting_requests


@dataclass(frozen=True, slots=True)
class LinkView:
    """The WAN line between datacenters ``a`` and ``b`` (either direction) as seen now."""

    a: str
    b: str
    estimate: LinkEstimate


@dataclass(frozen=True, slots=True)
class FleetView:
    p: tuple[PSnapshot, ...]
    md: tuple[MdSnapshot, ...]
    rld: tuple[RldSnapshot, ...] = ()
    links: tuple[LinkView, ...] = ()

    def link(self, a: str, b: str) -> LinkEstimate | None:
        for k in self.links:
            if (k.a == a and k.b == b) or (k.a == b and k.b == a):
                return k.estimate
        return None


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    prompt_tokens: int
    block_tokens: int
    kv_bytes_per_token: int
    block_hashes: tuple[int, ...] = ()  # the prompt's full blocks (prefix_hash remembers them)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.block_tokens < 1 or self.kv_bytes_per_token < 0:
            raise InvalidInput(
                "placement request: prompt_tokens and block_tokens must be >= 1, kv_bytes_per_token >= 0"
            )

    def matched_tokens(self, blocks: int) -> int:
        """Tokens of ``blocks`` cached blocks that need no KV (the last token is always computed)."""
        return max(0, min(self.prompt_tokens - 1, blocks * self.block_tokens))


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    policy: PlacementPolicy = PlacementPolicy.PREFIX_AWARE
    balance_queue: int = 16
    balance_tpot_s: float | None = None
    md_kv_use_max: float = 1.0
    md_wait_s_per_waiting: float = 0.0
    memory_blocks: int = 1_000_000  # prefix_hash: block hashes remembered (LRU)

    def __post_init__(self) -> None:
        if self.balance_queue < 0 or self.md_wait_s_per_waiting < 0 or self.memory_blocks < 1:
            raise ConfigError("placement: balance_queue and md_wait_s_per_waiting >= 0, memory_blocks >= 1")
        if not 0 < self.md_kv_use_max <= 1 or (self.balance_tpot_s is not None and self.balance_tpot_s <= 0):
            raise ConfigError("placement: md_kv_use_max in (0, 1], balance_tpot_s > 0")


@dataclass(frozen=True, slots=True)
class Placement:
    p: str
    md: str
    rld: str | None  # the RLD a relay would use (None: no healthy RLD beside this P)
    matched_tokens: int  # the chosen MD's matched prefix, in tokens (its mirror's view)
    estimated_ttft_s: float
    reason: PlacementReason


@dataclass(frozen=True, slots=True)
class PlacementRefusal:
    reason: RefusalReason
    detail: str


class PlacementMemory:
    """What one router remembers between placements: the round-robin cursor and, for
    ``prefix_hash``, which MD each block hash was last sent to (bounded, least recently used
    first out). Sans-I/O; one per router, never shared."""

    def __init__(self, capacity_blocks: int = 1_000_000) -> None:
        if capacity_blocks < 1:
            raise ConfigError(f"placement memory: capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._cursor = 0
        self._sent: OrderedDict[int, str] = OrderedDict()

    def next_turn(self, n: int) -> int:
        turn = self._cursor % n
        self._cursor += 1
        return turn

    def remembered(self, hashes: Sequence[int]) -> tuple[str, int] | None:
        """The MD the deepest remembered block of ``hashes`` went to, and that depth in blocks."""
        for depth in range(len(hashes), 0, -1):
            md = self._sent.get(hashes[depth - 1])
            if md is not None:
                return md, depth
        return None

    def remember(self, hashes: Sequence[int], md: str) -> None:
        sent = self._sent
        for h in hashes:
            sent[h] = md
            sent.move_to_end(h)
        while len(sent) > self.capacity_blocks:
            sent.popitem(last=False)

    def forget(self, md: str) -> None:
        """``md`` left the fleet (restarted with an empty cache, or removed)."""
        for h in [h for h, m in self._sent.items() if m == md]:
            del self._sent[h]

    def __len__(self) -> int:
        return len(self._sent)


def choose_rld(rlds: Sequence[RldSnapshot], datacenter: str | None = None) -> str | None:
    """The least loaded healthy, not draining RLD (in ``datacenter`` when given); first on ties."""
    best: RldSnapshot | None = None
    for r in rlds:
        if not r.healthy or r.draining or (datacenter is not None and r.datacenter != datacenter):
            continue
        if best is None or r.running_requests < best.running_requests:
            best = r
    return None if best is None else best.name


def place(
    request: PlacementRequest,
    fleet: FleetView,
    config: PlacementConfig | None = None,
    memory: PlacementMemory | None = None,
) -> Placement | PlacementRefusal:
    """Place one request (see the module docstring). ``memory`` is required for ``round_robin``
    and ``prefix_hash``, which update it."""
    config = config or PlacementConfig()
    policy = config.policy
    p_by_dc = _best_p_per_datacenter(fleet.p)
    if not p_by_dc:
        return PlacementRefusal(RefusalReason.NO_P, "no healthy, undrained P instance")
    live = [m for m in fleet.md if m.healthy and not m.draining]
    if not live:
        return PlacementRefusal(RefusalReason.NO_MD, "no healthy, undrained MD instance")
    ps = (
        [p for p in fleet.p if p.healthy and not p.draining]
        if policy is PlacementPolicy.PREFIX_AWARE
        else list(p_by_dc.values())
    )
    routes = [(m, _routes(m, ps, fleet)) for m in live]
    reachable = [(m, r) for m, r in routes if r]
    if not reachable:
        return PlacementRefusal(RefusalReason.NO_ROUTE, "no healthy P's datacenter has a link to a live MD")
    if policy is PlacementPolicy.ORACLE:
        return _oracle(request, reachable, fleet, config)
    if policy is PlacementPolicy.ROUND_ROBIN:
        m, r = reachable[_need(memory).next_turn(len(reachable))]
        return _finish(request, m, r, fleet, config, PlacementReason.ROUND_ROBIN)
    ok = _balanced(reachable, config)
    if policy is PlacementPolicy.PREFIX_AWARE:
        return _prefix_aware(request, ok, fleet, config, memory)
    if policy is PlacementPolicy.LEAST_LOADED:
        m, r = _least_loaded(ok, memory)
        return _finish(request, m, r, fleet, config, PlacementReason.LEAST_LOADED)
    return _prefix_hash(request, ok, fleet, config, _need(memory))


# A P that reaches the MD, and the line between them (None: the same datacenter).
Route = tuple[PSnapshot, LinkEstimate | None]
Candidate = tuple[MdSnapshot, list[Route]]


def _need(memory: PlacementMemory | None) -> PlacementMemory:
    if memory is None:
        raise InvalidInput("placement: round_robin and prefix_hash need a PlacementMemory")
    return memory


def _best_p_per_datacenter(ps: Sequence[PSnapshot]) -> dict[str, PSnapshot]:
    best: dict[str, PSnapshot] = {}
    for p in ps:
        if not p.healthy or p.draining:
            continue
        cur = best.get(p.datacenter)
        if cur is None or p.queue_s < cur.queue_s:
            best[p.datacenter] = p
    return best


def _routes(md: MdSnapshot, ps: Sequence[PSnapshot], fleet: FleetView) -> list[Route]:
    out: list[Route] = []
    for p in ps:
        dc = p.datacenter
        if dc == md.datacenter:
            out.append((p, None))
        else:
            link = fleet.link(dc, md.datacenter)
            if link is not None:
                out.append((p, link))
    return out


def _balanced(cands: list[Candidate], config: PlacementConfig) -> list[Candidate]:
    limit = min(m.waiting_requests for m, _ in cands) + config.balance_queue
    cap = config.balance_tpot_s
    hot = [cap is not None and m.step_s >= cap for m, _ in cands]
    if all(hot):
        hot = [False] * len(cands)
    ok = [
        c
        for c, h in zip(cands, hot, strict=True)
        if not h and c[0].waiting_requests <= limit and c[0].kv_use_fraction < config.md_kv_use_max
    ]
    return ok or cands


def _least_loaded(cands: list[Candidate], memory: PlacementMemory | None) -> Candidate:
    low = min(m.load for m, _ in cands)
    ties = [c for c in cands if c[0].load == low]
    return ties[memory.next_turn(len(ties))] if memory is not None and len(ties) > 1 else ties[0]


def _ttft(
    request: PlacementRequest, md: MdSnapshot, route: Route, blocks: int, config: PlacementConfig
) -> float:
    p, link = route
    missing = request.prompt_tokens - request.matched_tokens(blocks)
    t = p.queue_s + md.waiting_requests * config.md_wait_s_per_waiting
    if p.prefill_tokens_per_s:
        p_has = blocks if p.matched_blocks is None else p.matched_blocks
        t += (request.prompt_tokens - request.matched_tokens(p_has)) / p.prefill_tokens_per_s
    if link is not None:
        t += link.transfer_s(missing * request.kv_bytes_per_token)
    return t


def _best_route(
    request: PlacementRequest, md: MdSnapshot, routes: list[Route], blocks: int, config: PlacementConfig
) -> tuple[Route, float]:
    best, best_t = routes[0], _ttft(request, md, routes[0], blocks, config)
    for r in routes[1:]:
        t = _ttft(request, md, r, blocks, config)
        if t < best_t:
            best, best_t = r, t
    return best, best_t


def _prefix_aware(
    request: PlacementRequest,
    cands: list[Candidate],
    fleet: FleetView,
    config: PlacementConfig,
    memory: PlacementMemory | None,
) -> Placement:
    scored = []
    for md, routes in cands:
        route, t = _best_route(request, md, routes, md.matched_blocks, config)
        scored.append((t, md.load, md, route))
    best_t = min(t for t, _, _, _ in scored)
    low = min(load for t, load, _, _ in scored if t == best_t)
    ties = [(md, route, t) for t, load, md, route in scored if t == best_t and load == low]
    md, (p, _), t = ties[memory.next_turn(len(ties)) if memory is not None and len(ties) > 1 else 0]
    return _placement(request, p, md, md.matched_blocks, t, fleet, PlacementReason.BEST_TTFT)


def _oracle(
    request: PlacementRequest, cands: list[Candidate], fleet: FleetView, config: PlacementConfig
) -> Placement:
    best: tuple[int, float, int, MdSnapshot, PSnapshot] | None = None
    for md, routes in cands:
        blocks = md.matched_blocks if md.exact_matched_blocks is None else md.exact_matched_blocks
        (p, _), t = _best_route(request, md, routes, blocks, config)
        key = (-blocks, t, md.load, md, p)
        if best is None or key[:3] < best[:3]:
            best = key
    assert best is not None
    blocks, t, _, md, p = -best[0], best[1], best[2], best[3], best[4]
    return _placement(request, p, md, blocks, t, fleet, PlacementReason.EXACT_CACHE)


def _prefix_hash(
    request: PlacementRequest,
    cands: list[Candidate],
    fleet: FleetView,
    config: PlacementConfig,
    memory: PlacementMemory,
) -> Placement:
    seen = memory.remembered(request.block_hashes)
    chosen = next((c for c in cands if seen is not None and c[0].name == seen[0]), None)
    reason = PlacementReason.REMEMBERED_PREFIX
    if chosen is None:
        chosen, reason = _least_loaded(cands, memory), PlacementReason.NEW_PREFIX
    memory.remember(request.block_hashes, chosen[0].name)
    return _finish(request, chosen[0], chosen[1], fleet, config, reason)


def _finish(
    request: PlacementRequest,
    md: MdSnapshot,
    routes: list[Route],
    fleet: FleetView,
    config: PlacementConfig,
    reason: PlacementReason,
) -> Placement:
    (p, _), t = _best_route(request, md, routes, md.matched_blocks, config)
    return _placement(request, p, md, md.matched_blocks, t, fleet, reason)


def _placement(
    request: PlacementRequest,
    p: PSnapshot,
    md: MdSnapshot,
    blocks: int,
    ttft_s: float,
    fleet: FleetView,
    reason: PlacementReason,
) -> Placement:
    rld = choose_rld(fleet.rld, p.datacenter)
    return Placement(p.name, md.name, rld, request.matched_tokens(blocks), ttft_s, reason)
