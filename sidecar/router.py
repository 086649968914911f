"""The router: client API (gRPC ``Router`` service and an OpenAI-style HTTP endpoint with SSE),
the pipeline policy (``pddlink.routing``), a DRC mirror fed by MD's events, and one
``RequestRun`` per request.

Lifecycle: ``Router(cfg)``; ``await start()`` connects to the sidecars (gRPC channels are lazy; mutual
TLS 1.3 with each sidecar's identity checked when ``tls_dir`` is set, see ``sidecar.grpc_tls``) and
starts following MD's DRC and P's transfer state; ``generate(request)`` admits the request or
raises ``Overloaded`` (``sidecar.admission``), then yields merged tokens and ends with the trace;
``close()``. Per-request choices use only local state: the mirror (never blocks on MD), the link
model (its own flows plus P's reported backlog toward MD), P's and MD's prefill books and the
count of requests RLD is streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from engines_adapter import SamplingParams
from pddlink import metrics
from pddlink.drc import Mirror, decode_event, decode_snapshot
from pddlink.errors import InvalidInput, NotFound
from pddlink.kv.hashing import BlockHasher
from pddlink.routing import (
    LinkModel,
    OptionDecision,
    RoutingInputs,
    RoutingPolicy,
)
from pddlink.transport import PeerIdentity, TlsConfig, load_node
from sidecar.admission import Overloaded
from sidecar.backlog import POLL_INTERVAL_S, follow_backlog
from sidecar.grpc_tls import CallerCheck, open_channel
from sidecar.recompute import PrefillBook, TpotBook
from sidecar.role_health import RoleHealth
from sidecar.router_options import FORCEABLE, decide_option, forced_option, option_trace
from sidecar.router_run import RequestRun, RunInput
from sidecar.rpc import stubs

pb2, pb2_grpc = stubs()


@dataclass(frozen=True, slots=True)
class RouterConfig:
    p: str
    rld: str
    md: str
    relay_enabled: bool = True
    relay_min_wan_s: float = 0.15
    rld_capacity: int = 8
    rld_max_load: float = 1.0
    rld_tpot_s: float = 0.02
    singular_max_tokens: int = 4  # singular only for very short outputs (published: 3-4% of requests)
    line_mbit: float = 100.0
    rtt_ms: float = 30.0
    deadline_s: float = 30.0
    max_tokens_limit: int = 4096
    max_prompt_tokens: int = 8000
    vocab_size: int = 2048
    kv_bytes_per_token: int = 2048
    wan_links: int = 8  # P's WAN connection pool toward MD (a transfer holds one link)
    recompute: bool = True  # MD may prefill the missing suffix itself (ship or recompute)
    admission: bool = True  # reject at once what no option can end before its deadline
    p_prefill_tokens_per_s: float = 3300.0  # starting figures; the replies refine them
    md_prefill_tokens_per_s: float = 3300.0
    md_tpot_s: float = 0.02
    tls_dir: str = ""  # dev PKI: mutual TLS 1.3 to the sidecars and on the gRPC port; "" = plaintext
    name: str = "router0"  # this router's identity is router/<name>
    p_identity: str = "p/p0"  # who must answer at p, rld, md (checked against their certificates)
    rld_identity: str = "rld/rld0"
    md_identity: str = "md/md0"

    def __post_init__(self) -> None:
        if self.rld_capacity < 1 or self.line_mbit <= 0 or self.rtt_ms < 0 or self.deadline_s <= 0:
            raise InvalidInput("router: rld_capacity >= 1, line_mbit > 0, rtt_ms >= 0, deadline_s > 0")
        if (
            self.wan_links < 1
            or min(self.p_prefill_tokens_per_s, self.md_prefill_tokens_per_s, self.md_tpot_s) <= 0
        ):
            raise InvalidInput("router: prefill speeds and md_tpot_s must be > 0")
        for ident in (self.p_identity, self.rld_identity, self.md_identity):
            PeerIdentity.parse(ident)
        PeerIdentity("router", self.name)

    @property
    def identity(self) -> PeerIdentity:
        return PeerIdentity("router", self.name)

    def load_tls(self) -> TlsConfig | None:
        """This router's credentials from its node directory ``tls_dir`` (read only, never minted)."""
        return load_node(Path(self.tls_dir), self.identity) if self.tls_dir else None


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        self.tls = cfg.load_tls()
        self.health = RoleHealth(("p", "rld", "md"))  # which roles may get traffic (sidecar.role_health)
        self.channels = {
            n: open_channel(
                addr, self.tls, PeerIdentity.parse(ident), opts, interceptors=self.health.interceptors(n)
            )
            for n, addr, ident in (
                ("p", cfg.p, cfg.p_identity),
                ("rld", cfg.rld, cfg.rld_identity),
                ("md", cfg.md, cfg.md_identity),
            )
        }
        self.p = pb2_grpc.SidecarStub(self.channels["p"])
        self.rld = pb2_grpc.SidecarStub(self.channels["rld"])
        self.md = pb2_grpc.SidecarStub(self.channels["md"])
        self.health.watch(self.channels)
        self.rld_active = 0
        self.rld_down_until = 0.0
        self.mirror = Mirror(gap_timeout_s=2.0)
        self.hasher: BlockHasher | None = None
        self.root = 0
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
        self._backlog_task: asyncio.Task[None] | None = None
        self.ids = itertools.count(1)
        self.in_flight: dict[str, RequestRun] = {}
        self._mirror_task: asyncio.Task[None] | None = None
        self.mirror_error = ""  # why the DRC event stream from MD last broke
        self.caller_check: CallerCheck | None = None  # set by the gRPC server (who calls, with TLS)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.health.start()
        self._mirror_task = loop.create_task(self._follow_drc())
        self._backlog_task = loop.create_task(
            follow_backlog(self.p, pb2.StatusRequest(), self.link, POLL_INTERVAL_S)
        )

    async def close(self) -> None:
        for task in (self._mirror_task, self._backlog_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.health.close()
        for ch in self.channels.values():
            await ch.close(None)

    def rld_usable(self) -> bool:
        return (
            self.cfg.relay_enabled and time.monotonic() >= self.rld_down_until and self.health.usable("rld")
        )

    # -- DRC mirror ------------------------------------------------------------------------------

    async def _follow_drc(self) -> None:
        while True:
            try:
                async for batch in self.md.DrcEvents(pb2.DrcEventsRequest()):
                    now = time.monotonic()
                    if batch.snapshot:
                        snap = decode_snapshot(batch.snapshot)
                        if self.hasher is None or snap.root != self.root:
                            self.root = snap.root
                            self.hasher = BlockHasher("router", max(1, snap.block_size))
                        self.mirror.load_snapshot(snap, now)
                    for data in batch.events:
                        self.mirror.apply(decode_event(data), now)
                    if self.mirror.needs_resync:
                        break  # reconnect: the first message of a new stream is a snapshot
            except grpc.aio.AioRpcError as exc:  # MD restarting or unreachable: follow again shortly
                self.mirror_error = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(0.5)

    def matched_tokens(self, prompt: tuple[int, ...]) -> int:
        if self.hasher is None:
            return 0
        hashes = self.hasher.hash_blocks(list(prompt), parent=self.root)
        return self.mirror.match(hashes).matched_blocks * self.hasher.block_size

    # -- policy -------------------------------------------------------------------------------------

    def decide(
        self, prompt: tuple[int, ...], max_tokens: int, forced: str, deadline_s: float
    ) -> tuple[OptionDecision, int]:
        """Ship, relay, recompute, relay + recompute or singular (``sidecar.router_options``); a
        forced pipeline (tests, the demo's warm-up) skips the choice and admission."""
        matched = min(self.matched_tokens(prompt), len(prompt))
        now = time.monotonic()
        routing = RoutingInputs(
            prompt_tokens=len(prompt),
            matched_tokens=matched,
            kv_bytes_per_token=self.cfg.kv_bytes_per_token,
            max_output_tokens=max_tokens,
            link=self.link.estimate(now),
            rld_available=self.rld_usable(),
            rld_active=self.rld_active,
            rld_capacity=self.cfg.rld_capacity,
            rld_tpot_s=self.cfg.rld_tpot_s,
        )
        if forced:
            return forced_option(routing, forced, self.policy), matched
        return decide_option(self, routing, deadline_s), matched

    # -- what the runs report back (``sidecar.router_legs.Cluster``) -------------------------------

    def on_prefilled(self, request_id: str, new_tokens: int, seconds: float) -> None:
        self.p_book.ready(request_id, new_tokens, seconds)

    def on_md_ready(self, request_id: str, new_tokens: int, seconds: float) -> None:
        self.md_book.ready(request_id, new_tokens, seconds)

    # -- requests -----------------------------------------------------------------------------------

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
    ) -> AsyncIterator[dict[str, Any]]:
        """Validates (``InvalidInput``, nothing changed), admits (``Overloaded``, nothing started),
        then yields token dicts and a final trace."""
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
        inp = RunInput(
            rid,
            tuple(prompt),
            sampling,
            deadline_s,
            option.pipeline,
            decision.reason.value,
            decision.wan_estimate_s,
            option,
        )
        run = RequestRun(self, inp)
        run.trace["mirror_matched_tokens"] = matched
        run.trace.update(option_trace(decision))
        self.in_flight[rid] = run
        flow = rid  # P reports its transfer state by request id (``sidecar.backlog``)
        now = time.monotonic()
        if option.ships_kv:
            self.link.start_flow(flow, decision.wan_bytes, now)
        if option.recomputes:
            self.md_book.start(rid, len(prompt) - matched)
        self.p_book.start(rid, len(prompt) - matched)  # recompute too: P warms its own cache
        try:
            async for tok in run.run():
                yield {"position": tok.position, "token_id": tok.token_id, "source": tok.source}
        finally:
            self.in_flight.pop(rid, None)
            self.md_book.finish(rid)
            self.p_book.finish(rid)
            if option.ships_kv:
                with contextlib.suppress(NotFound):
                    self.link.finish_flow(flow, time.monotonic(), completed=bool(run.trace.get("wan_bytes")))
            self.md_tpot.observe(run.trace)
            if run.trace.get("rld_error") or "rld_lost_md_takes_over" in run.trace["fallbacks"]:
                self.rld_down_until = time.monotonic() + 2.0
        yield {
            "done": True,
            "request_id": rid,
            "outcome": run.trace["outcome"],
            "reason": run.trace["reason"],
            "trace": run.trace,
        }

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        st = self.mirror.staleness(now)
        by_pipeline: dict[str, int] = {}
        for run in self.in_flight.values():
            by_pipeline[run.inp.pipeline.value] = by_pipeline.get(run.inp.pipeline.value, 0) + 1
        est = self.link.estimate(now)
        return {
            "role": "router",
            "in_flight": by_pipeline,
            "rld_active": self.rld_active,
            "roles": self.health.status(),
            "grpc_tls": self.caller_check.status() if self.caller_check is not None else None,
            "drc_mirror": {
                "blocks": len(self.mirror),
                "epoch": st.epoch,
                "applied_seq": st.applied_seq,
                "seq_lag": st.seq_lag,
                "needs_resync": st.needs_resync,
                "last_error": self.mirror_error,
            },
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


_ = metrics  # the router's metrics are updated by RequestRun
