"""The router: per-request pipeline choice (``pddlink.routing``), one run per request
(``RunDriver`` of ``pddlink.lifecycle.RequestRun``), and a DRC mirror fed by MD's events. Its
client APIs (gRPC ``Router`` service, OpenAI-style HTTP with SSE) are in ``router.api``.

The engine kind (``RouterConfig.engine``: the reference engine's sidecars over gRPC, or vLLM's
OpenAI servers beside pddlink's vLLM sidecars) lives behind one interface, ``router.backend``.

Lifecycle: ``Router(cfg)``; ``await start()`` starts the backend (reference: connects to the sidecars
-- gRPC channels are lazy; mutual TLS 1.3 with each sidecar's identity checked when ``tls_dir`` is
set, see ``pddlink.serving.grpc_tls`` -- and follows MD's DRC and P's transfer state); ``generate(request)``
admits the request or raises ``Overloaded`` (``router.admission``), then yields merged tokens and
ends with the trace; ``close()``. Per-request choices use only local state: the DRC view (never
blocks on MD), the link model (its own flows plus P's reported backlog toward MD), P's and MD's
prefill books and the count of requests RLD is streaming.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from engines_adapter import SamplingParams
from pddlink import metrics
from pddlink.errors import InvalidInput, NotFound
from pddlink.lifecycle import RunSpec, StallBreaker, md_stall_bound
from pddlink.roles import Role
from pddlink.routing import (
    DecisionReason,
    LinkModel,
    Option,
    OptionDecision,
    RoutingInputs,
    RoutingPolicy,
)
from pddlink.routing.books import PrefillBook, TpotBook
from pddlink.serving.grpc_tls import CallerCheck
from router.admission import Overloaded
from router.backend import EngineBackend, make_backend
from router.config import RouterConfig, VllmEngineConfig
from router.options import FORCEABLE, decide_option, forced_option, option_trace
from router.run import RunDriver

__all__ = ["Router", "RouterConfig", "VllmEngineConfig"]

RLD_COOL_DOWN_S = 2.0  # after RLD failed a request, new requests keep off it this long


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tls = cfg.load_tls()
        self.backend: EngineBackend = make_backend(cfg, self.tls)  # what differs per engine kind
        self.rld_active = 0
        self.rld_down_until = 0.0
        self.md_stalls = StallBreaker()  # MD stalled lately: the requests the router places avoid it
        self.link = LinkModel(cfg.line_mbit * 1e6 / 8, cfg.rtt_ms / 1e3, pool_size=cfg.wan_links)
        self.policy = RoutingPolicy(
            relay_enabled=cfg.relay_enabled,
            relay_min_wan_s=cfg.relay_min_wan_s,
            rld_max_load=cfg.rld_max_load,
            singular_max_output_tokens=cfg.singular_max_tokens,
            recompute_enabled=cfg.recompute,
        )
        self.p_book = PrefillBook(cfg.p_prefill_tokens_per_s)
        self.md_book = PrefillBook(cfg.md_prefill_tokens_per_s)
        self.md_tpot = TpotBook(cfg.md_tpot_s)
        self.ids = itertools.count(1)
        self.in_flight: dict[str, RunDriver] = {}
        self.caller_check: CallerCheck | None = None  # set by the gRPC server (who calls, with TLS)

    async def start(self) -> None:
        await self.backend.start(self.link)

    async def close(self) -> None:
        await self.backend.close()

    def rld_usable(self, now: float | None = None) -> bool:
        t = time.monotonic() if now is None else now
        return self.cfg.relay_enabled and t >= self.rld_down_until and self.backend.usable("rld")

    def rld_reachable(self, now: float) -> bool:
        """RLD can take a rescue of a request MD lost: relay enabled and its channel up (a cool-down
        after a failed request keeps only new placements off it)."""
        return self.cfg.relay_enabled and self.backend.usable("rld")

    def md_usable(self, now: float | None = None) -> bool:
        """MD may get new requests the router places: not stalled lately, its channel healthy."""
        t = time.monotonic() if now is None else now
        return self.md_stalls.usable(t) and self.backend.usable("md")

    # -- policy -------------------------------------------------------------------------------------

    def decide(
        self, prompt: tuple[int, ...], max_tokens: int, forced: str, deadline_s: float
    ) -> tuple[OptionDecision, int]:
        """Ship, relay, recompute, relay + recompute or singular (``router.options``); a
        forced pipeline (tests, the demo's warm-up) skips the choice and admission."""
        matched = min(self.backend.matched_tokens(prompt), len(prompt))
        now = time.monotonic()
        routing = RoutingInputs(
            prompt_tokens=len(prompt),
            matched_tokens=matched,
            kv_bytes_per_token=self.cfg.kv_bytes_per_token,
            max_output_tokens=max_tokens,
            link=self.link.estimate(now),
            rld_available=self.rld_usable(now),
            rld_active=self.rld_active,
            rld_capacity=self.cfg.rld_capacity,
            rld_tpot_s=self.cfg.rld_tpot_s,
        )
        if forced:
            return forced_option(routing, forced, self.policy), matched
        if not self.md_usable(now) and routing.rld_available and self.rld_active < self.cfg.rld_capacity:
            return OptionDecision(Option.SINGULAR, DecisionReason.MD_UNAVAILABLE, 0, 0.0, ()), matched
        return decide_option(self, routing, deadline_s), matched

    # -- what the runs report back (``router.legs.Cluster``) -------------------------------

    def on_prefilled(self, request_id: str, new_tokens: int, seconds: float) -> None:
        self.p_book.ready(request_id, new_tokens, seconds)

    def on_md_ready(self, request_id: str, new_tokens: int, seconds: float) -> None:
        self.md_book.ready(request_id, new_tokens, seconds)

    def on_md_stalled(self, seconds: float) -> None:
        """A run saw MD's stream make no progress (``pddlink.lifecycle.stall``): new requests the
        router places keep off MD until it is healthy again (``StallBreaker``), and every other run
        in flight suspects its own MD stream (``MdSuspected``: an outage silences them all)."""
        self.md_stalls.stalled(time.monotonic())
        for run in self.in_flight.values():
            run.suspect_md()

    def validate(self, prompt: list[int], sampling: SamplingParams, deadline_s: float, pipeline: str) -> None:
        cfg = self.cfg
        if not prompt:
            raise InvalidInput("prompt must not be empty")
        if len(prompt) > cfg.max_prompt_tokens:
            raise InvalidInput(f"prompt has {len(prompt)} tokens; the limit is {cfg.max_prompt_tokens}")
        if any(not 0 <= t < cfg.vocab_size for t in prompt):
            raise InvalidInput(f"prompt token ids must be in [0, {cfg.vocab_size})")
        if sampling.max_tokens > cfg.max_tokens_limit:
            raise InvalidInput(f"max_tokens {sampling.max_tokens} exceeds the limit {cfg.max_tokens_limit}")
        if not 0 < deadline_s <= 600:
            raise InvalidInput(f"deadline_s must be in (0, 600], got {deadline_s}")
        if pipeline and pipeline not in FORCEABLE:
            raise InvalidInput(f"pipeline must be one of {', '.join(FORCEABLE)}, got {pipeline!r}")

    async def generate(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        deadline_s: float = 0.0,
        pipeline: str = "",
        request_id: str = "",
        arrived: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Validates (``InvalidInput``, nothing changed), admits (``Overloaded``, nothing started),
        then yields token dicts and a final trace. The deadline counts from ``arrived`` (when the
        API got the request; default now), so time spent in the checks and queues is its own."""
        deadline_s = deadline_s or self.cfg.deadline_s
        self.validate(prompt, sampling, deadline_s, pipeline)
        rid = request_id or f"req-{next(self.ids)}-{time.time_ns() % 10**9}"
        if rid in self.in_flight:
            raise InvalidInput(f"request id {rid!r} is already in flight")
        decision, matched = self.decide(tuple(prompt), sampling.max_tokens, pipeline, deadline_s)
        option = decision.option
        metrics.DECISIONS.labels(option=option.value if option else "rejected").inc()
        if option is None:
            raise Overloaded.of(decision, deadline_s)
        spec = RunSpec(
            rid,
            tuple(prompt),
            sampling,
            deadline_s,
            option.pipeline,
            decision.reason.value,
            decision.wan_estimate_s,
            mirror_matched_tokens=matched,
            option=option,
            md_stall_s=md_stall_bound(self.link.estimate(time.monotonic()).rtt_s, self.md_tpot.tpot_s)
            if self.backend.md_stall_detection
            else math.inf,
        )
        legs = lambda deadline: self.backend.legs(self, deadline)  # noqa: E731
        run = self.in_flight[rid] = RunDriver(
            legs,
            spec,
            self.rld_usable,
            arrived=arrived,
            on_md_stalled=self.on_md_stalled,
            rld_reachable=self.rld_reachable,
        )
        flow = rid  # P reports its transfer state by request id (``pddlink.serving.backlog``)
        now = time.monotonic()
        if option.ships_kv:
            self.link.start_flow(flow, decision.wan_bytes, now)
        if option.recomputes:
            self.md_book.start(rid, len(prompt) - matched)
        self.p_book.start(rid, len(prompt) - matched)  # recompute too: P warms its own cache
        tokens = run.run()
        try:
            async for tok in tokens:
                yield {"position": tok.position, "token_id": tok.token_id, "source": tok.source}
        finally:
            await tokens.aclose()  # a client that went away: the run ends (cancelled) and its legs go now
            self.in_flight.pop(rid, None)
            self.md_book.finish(rid)
            self.p_book.finish(rid)
            trace = run.trace
            if option.ships_kv:
                with contextlib.suppress(NotFound):
                    self.link.finish_flow(flow, time.monotonic(), completed=bool(trace.wan_bytes))
            if trace.rld_suspect:
                self.rld_down_until = time.monotonic() + RLD_COOL_DOWN_S
            if trace.md_streamed:
                self.md_stalls.healthy()
        out = trace.to_dict()
        out.update(option_trace(decision))
        self.md_tpot.observe(out)
        yield {
            "done": True,
            "request_id": rid,
            "outcome": out["outcome"],
            "reason": out["reason"],
            "trace": out,
        }

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        by_pipeline: dict[str, int] = {}
        for run in self.in_flight.values():
            by_pipeline[run.spec.pipeline.value] = by_pipeline.get(run.spec.pipeline.value, 0) + 1
        est = self.link.estimate(now)
        return {
            "role": Role.ROUTER.value,
            "in_flight": by_pipeline,
            "rld_active": self.rld_active,
            "md": {"usable": self.md_usable(now), "stalls": self.md_stalls.stalls},
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
            },
        }
