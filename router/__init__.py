"""The router: per-request pipeline choice (``pddlink.routing``), one run per request
(``RunDriver`` of ``pddlink.lifecycle.RequestRun``), and a DRC mirror fed by MD's events. Its
client APIs (gRPC ``Router`` service, OpenAI-style HTTP with SSE) are in ``router.api``.

The engine kind (``RouterConfig.engine``: the reference engine's sidecars over gRPC, or vLLM's
OpenAI servers beside pddlink's vLLM sidecars) lives behind one interface, ``router.backend``.

Lifecycle: ``Router(cfg)``; ``await start()`` starts the backend (reference: connects to the sidecars
-- gRPC channels are lazy; mutual TLS 1.3 with each sidecar's identity checked when ``tls_dir`` is
set, see ``pddlink.serving.grpc_tls`` -- and follows MD's DRC and P's transfer state); ``generate(request)``
admits the request or raises ``Overloaded`` (``router.admission``), then yields merged tokens and
ends with the trace; ``close()``.

Request identity: what the sidecars key a request by (``RunSpec.request_id``, every leg's id, P's
transfer, vLLM's ``kv_transfer_params``) is minted here per request (``mint_request_key``:
``<router name>-<128 random bits, hex>``), never the client's id: two routers in front of the same
sidecars, even two with one name, never share a key. The client's id (or one made up here) is a
label only: the answer and the trace carry it (``request_id``) next to the key (``request_key``).

Per-request choices use only local state: the DRC view (never blocks on MD), the link model (its
own flows plus P's reported backlog toward MD), P's and MD's prefill books and the count of
requests RLD is streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

from engines_adapter import SamplingParams
from pddlink import metrics
from pddlink.errors import InvalidInput, NotFound
from pddlink.lifecycle import FailReason, RunOutcome, RunSpec, RunTrace, md_stall_bound
from pddlink.roles import Role
from pddlink.routing import (
    DecisionReason,
    LinkModel,
    MdRun,
    Option,
    OptionDecision,
    Pipeline,
    RoutingInputs,
    RoutingPolicy,
)
from pddlink.routing.books import PrefillBook, StallLedger, TpotBook
from pddlink.routing.outputs import OutputBook, missed_tpot
from pddlink.serving.grpc_tls import CallerCheck
from router.admission import Overloaded
from router.answer import GenerateEvent, RequestEnd, StreamedToken
from router.backend import EngineBackend, make_backend
from router.config import RouterConfig, VllmEngineConfig
from router.fleet import Route
from router.options import decide_option, forced_option, option_trace
from router.request import RequestRuns, mint_request_key, streamed, validate_request
from router.run import RunDriver

__all__ = ["RequestEnd", "Router", "RouterConfig", "StreamedToken", "VllmEngineConfig", "mint_request_key"]

# sent into ``generate`` (``asend``) in place of reading the next token: the client needs no more
# (a stop string); the run ends and the request's final item comes back as the answer to the send
STOP = "stop"
RLD_COOL_DOWN_S = 2.0  # after RLD failed a request, new requests keep off it this long
REPLACE_MIN_LEFT_S = 1.0  # a run that lost its MD runs again elsewhere only with this much time left
log = logging.getLogger(__name__)


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tls = cfg.load_tls()
        self.backend: EngineBackend = make_backend(cfg, self.tls)  # what differs per engine kind
        self.fleet = self.backend.fleet  # the instances and where each request goes (router.fleet)
        self.rld_active = 0
        self.rld_down_until: dict[str, float] = {}  # RLD name -> new requests keep off it until then
        self.policy = RoutingPolicy(
            relay_enabled=cfg.relay_enabled,
            relay_min_wan_s=cfg.relay_min_wan_s,
            rld_max_load=cfg.rld_max_load,
            singular_max_output_tokens=cfg.singular_max_tokens,
            recompute_enabled=cfg.recompute,
            rld_token_budget=cfg.rld_token_budget,
        )
        self.p_book = PrefillBook(cfg.p_prefill_tokens_per_s)
        self.md_book = PrefillBook(cfg.md_prefill_tokens_per_s)
        self.md_tpot = TpotBook(cfg.md_tpot_s)
        self.rld_tpot = TpotBook(cfg.rld_tpot_s, source="rld")  # judged by it under a TPOT SLO
        self.outputs = OutputBook()  # what the TPOT bound spreads a stall over; RLD's token share
        self.stalls = StallLedger()  # each MD's recompute time: taken out of what md_tpot learns
        self.ids = itertools.count(1)
        self.in_flight: dict[str, RunDriver] = {}  # by request key
        self.labels_in_flight: set[str] = set()  # the clients' ids of those requests
        self.running_at: dict[str, tuple[int, int]] = {}  # label -> in flight on its MD, RLD when admitted
        self.routes: dict[str, Route] = {}  # a run's key -> where it runs (now: moves change it)
        self.bounds: dict[str, int] = {}  # a run's key -> its output bound (max_tokens)
        self.produced: dict[str, int] = {}  # a run's key -> the tokens it has streamed so far
        self.moves: dict[str, list[dict[str, str]]] = {}  # a run's key -> its moves within a role
        self.caller_check: CallerCheck | None = None  # set by the gRPC server (who calls, with TLS)

    @property
    def link(self) -> LinkModel:
        """The WAN line of the first link (the whole WAN with the old three addresses)."""
        return next(iter(self.fleet.links.values()))

    async def start(self) -> None:
        await self.backend.start()

    async def close(self) -> None:
        await self.backend.close()

    def rld_usable(self, route: Route, now: float | None = None) -> bool:
        """The route's RLD may take a new request: relay enabled, in placement, not cooling down."""
        t = time.monotonic() if now is None else now
        rld = route.rld
        if rld is None or not self.cfg.relay_enabled:
            return False
        return t >= self.rld_down_until.get(rld.name, 0.0) and self.fleet.in_placement(rld.name, t)

    def rld_reachable(self, route: Route, now: float) -> bool:
        """The route's RLD can take a rescue of a request MD lost: relay enabled and its channel up (a
        cool-down after a failed request keeps only new placements off it)."""
        return self.cfg.relay_enabled and route.rld is not None and self.backend.usable(route.rld.name)

    def md_usable(self, route: Route, now: float | None = None) -> bool:
        """The route's MD may get new requests the router places: not stalled lately, healthy."""
        t = time.monotonic() if now is None else now
        return route.md_usable and self.fleet.in_placement(route.md.name, t)

    def drain(self, instance: str, *, undo: bool = False) -> dict[str, Any]:
        """An operator takes ``instance`` out of placement (``undo``: back in); its requests end
        normally. ``NotFound`` for a name not in the topology."""
        now = time.monotonic()
        (self.fleet.undrain if undo else self.fleet.drain)(instance, now)
        fleet = self.fleet
        return {
            "instance": instance,
            "draining": instance in fleet.drained,
            "running": fleet.running[instance],
        }

    # -- policy -------------------------------------------------------------------------------------

    def decide(
        self, prompt: tuple[int, ...], max_tokens: int, forced: str, deadline_s: float
    ) -> tuple[OptionDecision, int]:
        """``decide_route`` without the route."""
        decision, matched, _ = self.decide_route(prompt, max_tokens, forced, deadline_s)
        return decision, matched

    def decide_route(
        self, prompt: tuple[int, ...], max_tokens: int, forced: str, deadline_s: float
    ) -> tuple[OptionDecision, int, Route]:
        """Where (``router.fleet``: P, MD, RLD) and how: ship, relay, recompute, relay + recompute or
        singular (``router.options``); a forced pipeline (tests, the demo's warm-up) skips the
        choice and admission."""
        now = time.monotonic()
        route = self.fleet.place(prompt, now)
        matched = min(route.matched_tokens, len(prompt))
        routing = RoutingInputs(
            prompt_tokens=len(prompt),
            matched_tokens=matched,
            kv_bytes_per_token=self.cfg.kv_bytes_per_token,
            max_output_tokens=max_tokens,
            link=route.link.estimate(now),
            rld_available=self.rld_usable(route, now),
            rld_active=self.fleet.running[route.rld.name] if route.rld is not None else 0,
            rld_capacity=self.cfg.rld_capacity,
            rld_tpot_s=self.rld_tpot_s(route),
        )
        if forced:
            return forced_option(routing, forced, self.policy), matched, route
        md_out = not self.md_usable(route, now)
        if md_out and routing.rld_available and routing.rld_active < self.cfg.rld_capacity:
            return OptionDecision(Option.SINGULAR, DecisionReason.MD_UNAVAILABLE, 0, 0.0, ()), matched, route
        md_running = self.fleet.running[route.md.name]
        runs = self.md_runs(route.md.name) if self.cfg.slo_tpot_ms else ()
        return decide_option(self, routing, deadline_s, md_running, runs), matched, route

    def md_runs(self, md: str) -> tuple[MdRun, ...]:
        """The runs on ``md`` now: each one's output bound (``max_tokens``) and tokens so far."""
        on_md = (sid for sid, route in self.routes.items() if route.md.name == md)
        known = (sid for sid in on_md if sid in self.bounds)
        return tuple(MdRun(self.bounds[sid], self.produced.get(sid, 0)) for sid in known)

    def rld_tpot_s(self, route: Route) -> float:
        """RLD's time per token for the policy: the configured figure, or under a TPOT SLO what
        relayed requests RLD finished saw (``TpotBook``)."""
        if not self.cfg.slo_tpot_ms:
            return self.cfg.rld_tpot_s
        running = self.fleet.running[route.rld.name] if route.rld is not None else 0
        return self.rld_tpot.estimate(running, prior_per_request_s=self.md_tpot.per_request_s())

    # -- what the runs report back (``router.leg_driver.Cluster``) -------------------------------

    def on_prefilled(self, request_id: str, new_tokens: int, seconds: float) -> None:
        self.p_book.ready(request_id, new_tokens, seconds)
        route = self.routes.get(request_id)
        if route is not None:
            self.fleet.p_books[route.p.name].ready(request_id, new_tokens, seconds)

    def on_md_ready(self, request_id: str, new_tokens: int, seconds: float) -> None:
        self.md_book.ready(request_id, new_tokens, seconds)
        route = self.routes.get(request_id)
        if route is not None:
            self.stalls.add(route.md.name, seconds)

    def on_md_stalled(self, seconds: float, md: str = "") -> None:
        """A run saw ``md``'s stream make no progress (``pddlink.lifecycle.stall``): new requests
        the router places keep off that MD until it is healthy again (``StallBreaker``), and every
        other run in flight on it suspects its own MD stream (``MdSuspected``: an outage silences
        them all)."""
        md = md or next(m.name for m in self.fleet.members.values() if m.role is Role.MD)
        self.fleet.stalled(md, time.monotonic())
        for run in self.in_flight.values():
            route = self.routes.get(run.spec.request_id)
            if route is None or route.md.name == md:
                run.suspect_md()

    def validate(self, prompt: list[int], sampling: SamplingParams, deadline_s: float, pipeline: str) -> None:
        validate_request(self.cfg, prompt, sampling, deadline_s, pipeline)

    async def generate(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        deadline_s: float = 0.0,
        pipeline: str = "",
        request_id: str = "",
        arrived: float | None = None,
        request_key: str = "",
    ) -> AsyncGenerator[GenerateEvent, Any]:
        """Validates (``InvalidInput``, nothing changed), admits (``Overloaded``, nothing started),
        then yields ``StreamedToken``s and a final ``RequestEnd`` (``router.answer``; ``asend(STOP)``
        at a token: the final now). The deadline counts from ``arrived`` (when the API got the
        request; default now), so time spent in the checks and queues is its own.
        ``request_key``: for an in-process caller that finds the sidecars' records by a unique key
        of its own (``router.vllm_driver``); the client APIs never pass one, the router mints it.
        The trace's ``stamps_s`` (seconds since arrival, the router's clock): ``entered`` this call,
        ``placed`` (admitted and placed), ``sent`` (the first run's calls issued, P's among them),
        ``first_token`` (out of the run): the router's own part of TTFT (``harness.ttft_stages``)."""
        entered = time.monotonic()
        deadline_s = deadline_s or self.cfg.deadline_s
        label, rid, placed = self._admit(prompt, sampling, deadline_s, pipeline, request_id, request_key)
        runs = RequestRuns(rid, rid, *placed, stamps={"entered": entered, "placed": time.monotonic()})
        arrived = time.monotonic() if arrived is None else arrived
        self.labels_in_flight.add(label)
        try:
            tokens = self._runs(runs, prompt, sampling, deadline_s, arrived)
            try:
                async for tok in tokens:
                    if (yield tok) == STOP:
                        break
            finally:
                await tokens.aclose()  # a client that went away (or STOP): the run ends, its legs go
        finally:
            self.labels_in_flight.discard(label)
            running_at = self.running_at.pop(label, None)
        # stamps since the request arrived (the API's clock when it passed one)
        yield self._final(runs, label, min(arrived, entered), running_at)

    async def _runs(
        self,
        r: RequestRuns,
        prompt: list[int],
        sampling: SamplingParams,
        deadline_s: float,
        arrived: float,
    ) -> AsyncGenerator[StreamedToken, None]:
        """The request's runs, their tokens as they come: the first on its route; one that lost its
        P or MD before any token reached the client again on another route (``replacement``)."""
        await self._hold(r, len(prompt))
        while True:
            run = self._start(r.sid, prompt, sampling, deadline_s, r.decision, r.matched, r.route, arrived)
            r.run = run
            self.in_flight[r.key] = run
            tokens = run.run()
            r.stamps.setdefault("sent", time.monotonic())  # the first run's calls (P's among them) go out
            emitted = 0
            try:
                async for tok in tokens:
                    if "first_token" not in r.stamps:
                        r.stamps["first_token"] = time.monotonic()
                        md = self.routes.get(r.sid, r.route).md.name
                        r.stall_mark = (md, self.stalls.total(md))
                    emitted += 1
                    self.produced[r.sid] = emitted
                    yield streamed(run, tok)
            finally:
                await tokens.aclose()  # a client that went away: the run ends (cancelled), its legs go
                self.in_flight.pop(r.key, None)
                r.route = self.routes.get(r.sid, r.route)  # where the run ended (it may have moved)
                r.moved += self.moves.pop(r.sid, [])
                self._ended(r.sid, run, r.decision, r.route)
            if emitted:  # once tokens reached the client the machine's own fallbacks decided
                return
            again = self.replacement(run.trace, r.route, prompt, sampling, deadline_s, arrived)
            if again is None:
                return
            r.replaced_from.append({"p": r.route.p.name, "md": r.route.md.name})
            r.decision, r.matched, r.route = again
            r.sid = mint_request_key(self.cfg.name)  # a key of its own: the sidecars may hold the first

    def _admit(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        deadline_s: float,
        pipeline: str,
        request_id: str,
        request_key: str,
    ) -> tuple[str, str, tuple[OptionDecision, int, Route]]:
        """The checks before anything starts: the request (``InvalidInput``), its label and key (one
        of each in flight), the option and the route (``Overloaded`` when none serves it)."""
        self.validate(prompt, sampling, deadline_s, pipeline)
        label = request_id or f"req-{next(self.ids)}-{time.time_ns() % 10**9}"
        if label in self.labels_in_flight:
            raise InvalidInput(f"request id {label!r} is already in flight")
        rid = request_key or mint_request_key(self.cfg.name)  # what the sidecars key it by
        if rid in self.in_flight:
            raise InvalidInput(f"request key {rid!r} is already in flight")
        decision, matched, route = self.decide_route(tuple(prompt), sampling.max_tokens, pipeline, deadline_s)
        option = decision.option
        metrics.DECISIONS.labels(option=option.value if option else "rejected").inc()
        if option is None:
            raise Overloaded.of(decision, deadline_s)
        # in flight on its instances when admitted: what TpotBook pairs its TPOT with
        running = self.fleet.running
        self.running_at[label] = (running[route.md.name], running[route.rld.name] if route.rld else 0)
        return label, rid, (decision, matched, route)

    def _final(
        self, r: RequestRuns, label: str, origin: float, running_at: tuple[int, int] | None = None
    ) -> RequestEnd:
        """The request's last item: its outcome and the trace of its last run, with the choice, the
        placement (and the routes it left before its first token) and the router's stamps (seconds
        since ``origin``)."""
        run, route = r.run, r.route
        assert run is not None
        out = run.trace.to_dict()
        out.update(option_trace(r.decision), request_id=label, request_key=r.sid)
        out["placement"] = {
            "p": route.p.name,
            "md": route.md.name,
            "rld": route.rld.name if route.rld else None,
            "reason": route.reason,
            "replaced_from": r.replaced_from,
            "moved": r.moved,  # mid-run moves within a role: {"role", "from", "to"}
        }
        out["stamps_s"] = {k: v - origin for k, v in r.stamps.items()}
        if running_at is not None:  # requests in flight on its MD and RLD when it was admitted
            out["md_running"], out["rld_running"] = running_at
        if r.stall_mark is not None and r.stall_mark[0] == route.md.name:
            # MD's recomputes for other prompts while this one decoded there
            out["md_stall_s"] = round(self.stalls.total(route.md.name) - r.stall_mark[1], 6)
        self.md_tpot.observe(out)
        self.rld_tpot.observe(out)
        if run.trace.outcome is RunOutcome.FINISHED:
            tokens = out.get("tokens") or {}
            n = int(out.get("output_tokens") or 0)
            self.outputs.add(n, int(tokens.get("rld", 0)), self._missed_tpot(out, n))
        return RequestEnd(
            label,
            r.sid,
            run.trace.outcome,
            out["reason"],
            out,
            prompt_usage=run.calls.run.prompt_usage,  # P's prefix hit, as vLLM reports it
            prompt_logprobs=run.calls.run.prompt_logprobs,  # and P's prompt logprobs
        )

    async def _hold(self, r: RequestRuns, prompt_tokens: int) -> None:
        """A recompute the policy holds (``OptionDecision.hold_s``: MD's short runs end first) waits
        here, counted in MD's prefill queue meanwhile so that the choices made during the hold see
        it; a request that goes away while held leaves nothing behind."""
        hold = r.decision.hold_s
        if hold <= 0:
            return
        self.md_book.start(r.sid, prompt_tokens - r.matched)
        try:
            await asyncio.sleep(hold)
        except BaseException:
            self.md_book.finish(r.sid)
            raise
        r.stamps["held"] = time.monotonic()

    def _missed_tpot(self, out: dict[str, Any], n: int) -> bool:
        """A finished request's TPOT (after its first token, per further token) past the SLO's."""
        ttft, e2e = out.get("ttft_s"), out.get("e2e_s")
        if not isinstance(ttft, float) or not isinstance(e2e, float):
            return False
        return missed_tpot(ttft, e2e, n, self.cfg.slo_tpot_ms / 1e3 if self.cfg.slo_tpot_ms else None)

    def _start(
        self,
        sid: str,
        prompt: list[int],
        sampling: SamplingParams,
        deadline_s: float,
        decision: OptionDecision,
        matched: int,
        route: Route,
        arrived: float,
    ) -> RunDriver:
        """One run of the request on ``route``: its machine, legs and books."""
        option = decision.option
        assert option is not None
        spec = RunSpec(
            sid,
            tuple(prompt),
            sampling,
            deadline_s,
            option.pipeline,
            decision.reason.value,
            decision.wan_estimate_s,
            mirror_matched_tokens=matched,
            option=option,
            md_stall_s=md_stall_bound(route.link.estimate(time.monotonic()).rtt_s, self.md_tpot.tpot_s)
            if self.backend.md_stall_detection
            else math.inf,
        )
        self.routes[sid] = route
        self.bounds[sid] = sampling.max_tokens
        self.fleet.begin(route, relayed=option.pipeline is not Pipeline.P_MD)
        legs = lambda deadline: self.backend.legs(self, deadline, route)  # noqa: E731

        def here() -> Route:
            return self.routes.get(sid, route)  # a move within a role changes it

        run = RunDriver(
            legs,
            spec,
            lambda now: self.rld_usable(here(), now),
            arrived=arrived,
            on_md_stalled=lambda seconds: self.on_md_stalled(seconds, here().md.name),
            rld_reachable=lambda now: self.rld_reachable(here(), now),
            spare=lambda role, now: self.spare(sid, role, now),
            on_move=lambda role: self.move(sid, role, run),
        )
        now = time.monotonic()
        if option.ships_kv:  # P reports its transfer state by request id (``pddlink.serving.backlog``)
            route.link.start_flow(sid, decision.wan_bytes, now)
        if option.recomputes:
            self.md_book.start(sid, len(prompt) - matched)
        self.p_book.start(sid, len(prompt) - matched)  # recompute too: P warms its own cache
        self.fleet.p_books[route.p.name].start(sid, len(prompt) - matched)
        return run

    def _ended(self, sid: str, run: RunDriver, decision: OptionDecision, route: Route) -> None:
        option = decision.option
        assert option is not None
        self.routes.pop(sid, None)
        self.bounds.pop(sid, None)
        self.produced.pop(sid, None)
        self.fleet.end(route, relayed=option.pipeline is not Pipeline.P_MD)
        self.md_book.finish(sid)
        self.p_book.finish(sid)
        self.fleet.p_books[route.p.name].finish(sid)
        trace = run.trace
        if option.ships_kv:
            with contextlib.suppress(NotFound):
                sent = (trace.wan_bytes, trace.prefill.wan_seconds) if trace.prefill is not None else None
                route.link.finish_flow(sid, time.monotonic(), completed=bool(trace.wan_bytes), sent=sent)
        if trace.rld_suspect and route.rld is not None:
            self.rld_down_until[route.rld.name] = time.monotonic() + RLD_COOL_DOWN_S
        if trace.md_streamed:
            self.fleet.streamed(route.md.name)

    def replacement(
        self,
        trace: RunTrace,
        route: Route,
        prompt: list[int],
        sampling: SamplingParams,
        deadline_s: float,
        arrived: float,
    ) -> tuple[OptionDecision, int, Route] | None:
        """A run that failed before its first token because its P or its MD was lost (P
        unavailable; MD unreachable, lost, stalled, or out of placement now) runs again on
        another P or MD, if one is in placement and time is left: nothing reached the client, so
        nothing is duplicated. Once tokens flowed the machine's own fallbacks decide."""
        now = time.monotonic()
        left = deadline_s - (now - arrived)
        if trace.outcome is not RunOutcome.FAILED or left < REPLACE_MIN_LEFT_S:
            return None
        lost = self._lost(trace, route, now)
        if lost is None:
            return None  # it failed for another reason than an instance
        decision, matched, again = self.decide_route(tuple(prompt), sampling.max_tokens, "", left)
        moved = again.p.name != lost if lost == route.p.name else again.md.name != lost
        if decision.option is None or not again.md_usable or not moved:
            return None
        metrics.REPLACED.inc()
        log.warning("request %s: %s lost before the first token (%s); re-placed on %s, %s",
                    trace.request_id, lost, trace.reason_text, again.p.name, again.md.name)  # fmt: skip
        return decision, matched, again

    def spare(self, sid: str, role: Role, now: float) -> bool:
        """Run ``sid`` could move off its instance of ``role`` (P or MD): another one is in
        placement (never one the run lost before)."""
        route = self.routes.get(sid)
        if route is None or role not in (Role.P, Role.MD):
            return False
        name = route.md.name if role is Role.MD else route.p.name
        return self.fleet.spare(name, now, self._lost_by(sid))

    def _lost_by(self, sid: str) -> frozenset[str]:
        return frozenset(m["from"] for m in self.moves.get(sid, []))

    def move(self, sid: str, role: Role, run: RunDriver) -> None:
        """Run ``sid`` lost its instance of ``role``: placement again without it (nor any it lost
        before), the other roles kept; the run's next calls go there (``EngineBackend.retarget``)."""
        route = self.routes.get(sid)
        if route is None:
            return
        now = time.monotonic()
        lost = route.md if role is Role.MD else route.p
        avoid = self._lost_by(sid) | {lost.name}
        new = self.fleet.moved(route, role, run.spec.prompt, now, avoid)
        if new is None:  # the spare left placement meanwhile: the next leg meets the lost one again
            log.warning("request %s: %s lost; no other %s to move to", sid, lost.name, role.value)
            return
        to = new.md if role is Role.MD else new.p
        self.fleet.shift(lost, to)
        if role is Role.P:
            self.fleet.p_books[lost.name].finish(sid)
        with contextlib.suppress(NotFound):  # its shipment toward the lost instance is over
            route.link.finish_flow(sid, now, completed=False)
        self.routes[sid] = new
        self.moves.setdefault(sid, []).append({"role": role.value, "from": lost.name, "to": to.name})
        metrics.REPLACED.inc()
        log.warning("request %s: %s lost mid-request; moved to %s", sid, lost.name, to.name)
        self.backend.retarget(run.calls.calls, new)

    def _lost(self, trace: RunTrace, route: Route, now: float) -> str | None:
        """The instance a failed run lost, now out of placement; None when none was, or when its
        role has no other instance (one of each: nothing changes from the single-instance router)."""
        pools = {r: len(self.fleet.topology.members(r)) for r in (Role.P, Role.MD)}
        if trace.reason is FailReason.P_UNAVAILABLE and pools[Role.P] > 1:
            self.fleet.failed(route.p.name, now)
            return route.p.name
        if pools[Role.MD] < 2:
            return None
        if trace.reason in (FailReason.MD_UNREACHABLE, FailReason.MD_LOST, FailReason.MD_STALLED):
            self.fleet.failed(route.md.name, now)
            return route.md.name
        if not self.fleet.in_placement(route.md.name, now):
            return route.md.name
        return None

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        by_pipeline: dict[str, int] = {}
        for run in self.in_flight.values():
            by_pipeline[run.spec.pipeline.value] = by_pipeline.get(run.spec.pipeline.value, 0) + 1
        est = self.link.estimate(now)
        mds = [m for m in self.fleet.members.values() if m.role is Role.MD]
        return {
            "role": Role.ROUTER.value,
            "in_flight": by_pipeline,
            "rld_active": self.rld_active,
            "md": {
                "usable": any(self.fleet.in_placement(m.name, now) for m in mds),
                "stalls": sum(self.fleet.stalls[m.name].stalls for m in mds),
            },
            "grpc_tls": self.caller_check.status() if self.caller_check is not None else None,
            **self.backend.status(),  # engine, roles, drc_mirror
            "link": {
                "goodput_mbit": est.line_bytes_per_s * 8 / 1e6,
                "rtt_ms": est.rtt_s * 1e3,
                "flows_in_flight": est.flows_in_flight,
                "backlog_bytes": est.backlog_bytes,
            },
            "prefill_books": {  # what the option policy assumes about P's and MD's prefill
                "p_tokens_per_s": self.p_book.tokens_per_s,
                "p_queued_tokens": self.p_book.queued_tokens,
                "md_tokens_per_s": self.md_book.tokens_per_s,
                "md_queued_tokens": self.md_book.queued_tokens,
                "md_tpot_s": self.md_tpot.tpot_s,
                "md_output_tokens": self.outputs.tokens(),  # token-weighted mean of recent outputs
                "rld_token_share": self.outputs.rld_share(),  # against rld_token_budget
                "rld_tpot_s": self.rld_tpot.tpot_s,
            },
        }
