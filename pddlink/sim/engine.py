"""One simulated run: requests flow through P, the fast path or the WAN, RelayDecode and MainDecode.

Lifecycle of a request (DESIGN.md, "Roles and one request's path"), as simulated:

1. Arrival: the router matches the prompt's full blocks against every decode instance's DRC (the
   real ``pddlink.drc.PrefixIndex``; the sim's mirror is always fresh) and places the request with
   the router's own ``pddlink.routing.place`` (the deployment's placement policy; by default the
   least estimated TTFT among the not-overloaded instances, each behind its own site's WAN line:
   the best match on one shared line), P going to the least backlogged (ties go round, as the
   router's do). It then calls the real ``pddlink.routing.choose_option`` with that MD's line
   state (its backlog included; or, with ``DecodeSite.seen``, the router's own ``LinkModel`` of the
   line), P's queue, MD's recompute lane and RLD's load: ship, relay, recompute, relay + recompute
   or singular, or - when the deployment has deadlines and none meets them - rejected at once
   (counted apart). ``settle`` replays requests with the option forced (a warm-up).
2. P prefills the missing suffix (P's own prefix cache is taken to be aligned with the chosen decode
   instance's, which is what "a normal request always ends on MD" preserves; with
   ``Deployment.p_cache_blocks`` each P keeps its own and prefills what it lacks), then ships KV:
   the missing suffix over the fast path (intra-datacenter) or the WAN (once both its prefill and
   the reservation round trip it started at arrival are done; MD starts a P->MD request a round
   trip after the KV lands: P's notice back, the first token forward), and for a relayed or
   singular request the whole KV to RLD over the fast path. On recompute the token ids cross
   instead and MD prefills the suffix on its own lane (``sim.md_lane``: MD's prefill speed, on the
   TPOT headroom its decoding leaves).
3. RLD decodes at once. When the WAN transfer lands (or MD's recompute is done), ``choose_handoff_mode``
   (RLD's load) picks one-shot (RLD stops; MD stalls for one extend of the generated ids) or catch-up
   (RLD keeps decoding while MD extends, MD takes over after one more iteration).
4. MD finishes, unpins and inserts the prompt into its DRC. Singular requests finish on RLD and
   leave MD's cache alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pddlink.routing import (
    BacklogReport,
    FleetView,
    HandoffMode,
    LinkEstimate,
    LinkModel,
    LinkView,
    MdSnapshot,
    Option,
    Pipeline,
    Placement,
    PlacementConfig,
    PlacementMemory,
    PlacementPolicy,
    PlacementRequest,
    PSnapshot,
    RldSnapshot,
    choose_handoff_mode,
    choose_rld,
    place,
)
from pddlink.routing.outputs import OutputBook, missed_tpot
from pddlink.sim.cache import DecodeCache
from pddlink.sim.choice import choose
from pddlink.sim.deploy import Deployment, Kind, Link
from pddlink.sim.md_lane import MdPrefillLane
from pddlink.sim.records import Record, RunRecords
from pddlink.sim.resources import Clock, DecodeInstance, DecodeSeq, PrefillInstance
from pddlink.sim.trace import TraceRequest
from pddlink.sim.wan import LineStats, WanLine

# Cache-aware routing yields to balance when an instance's admission queue is this much longer than
# the shortest one (sequences waiting for a batch slot or KV room), and - with the deployment's
# ``balance_tpot_s`` - when its step time has reached that bound while another's has not: every
# sequence of an instance shares its step time, so one instance loaded past the TPOT bound by
# affinity puts all of its sequences over it.
BALANCE_QUEUE = 16
BACKLOG_POLL_S = 0.5  # the router reads P's transfer state this often (``pddlink.serving.backlog``)


@dataclass(slots=True)
class _Req:
    trace: TraceRequest
    hashes: tuple[int, ...]
    record: Record
    decode: DecodeInstance
    cache: DecodeCache
    tip: int | None
    pipeline: Pipeline
    option: Option
    line: WanLine
    link: Link  # the WAN line's figures (rtt) toward this request's MD
    back_s: float  # tokens from MD cross back to A
    md_lane: MdPrefillLane | None = None
    rld: DecodeInstance | None = None
    rld_seq: DecodeSeq | None = None
    rld_done: bool = False
    rid: str = ""  # the request's id in the router's link model (``DecodeSite.seen``)
    p_cache: DecodeCache | None = None  # its P's own prefix cache (``Deployment.p_cache_blocks``)
    wan_start_s: float = 0.0
    landed: bool = False
    released: bool = False
    md_ready: bool = False  # relay + recompute: MD finished its prefill


class Simulation:
    def __init__(self, deployment: Deployment, block_tokens: int) -> None:
        d = deployment
        self.d, self.block_tokens = d, block_tokens
        self.clock = Clock()
        self.prefill = [
            PrefillInstance(self.clock, d.prefill.model(d.fig), f"p{i}") for i in range(d.prefill.instances)
        ]
        sites = d.decode_sites()
        self.decode = [DecodeInstance(self.clock, d.decode.model(d.fig), n) for x in sites for n in x.names]
        self.md_site = [k for k, x in enumerate(sites) for _ in x.names]  # decode instance -> its site
        cap_blocks = max(1, d.drc_tokens_per_gpu * d.decode.gpus_per_instance // block_tokens)
        self.caches = [DecodeCache(cap_blocks) for _ in self.decode]
        self.relay = (
            [
                DecodeInstance(self.clock, d.relay.model(d.relay_fig or d.fig), f"r{i}")
                for i in range(d.relay.instances)
            ]
            if d.relay
            else []
        )
        self.rld_capacity = sum(r.max_seqs for r in self.relay)
        if d.rld_shares_p_chips and self.relay:
            for p in self.prefill:
                p.on_batch = self._p_batch_holds_rld
        # MainDecode's own prefill lane (recompute), one per decode instance, at MD's prefill speed,
        # on the share of its chips that decoding leaves within the TPOT bound (``sim.md_lane``)
        tpot_bound = d.balance_tpot_s or 0.03
        self.md_lanes = (
            [MdPrefillLane(self.clock, x, tpot_bound, chunk_tokens=d.md_chunk_tokens) for x in self.decode]
            if d.crosses_wan and d.policy.recompute_enabled
            else []
        )
        self.sites = sites
        self.lines = [
            WanLine(self.clock, k.wan_bytes_s, k.rtt_s, k.pool_size, k.flow_cap_bytes_s, k.fifo_pool)
            for k in (x.link for x in sites)
        ]
        self.line = self.lines[0]
        self.records = RunRecords()
        self.outputs = OutputBook()  # the output lengths the TPOT bound judges a recompute's stall by
        self.finished = OutputBook()  # RLD's share of the tokens of finished requests (its token budget)
        self.crosses_wan = d.crosses_wan
        self.back_s = [x.link.rtt_s / 2 if d.crosses_wan else 0.0 for x in sites]  # MD's tokens back to A
        self.placement = PlacementConfig(d.placement, BALANCE_QUEUE, d.balance_tpot_s)
        self.memory = PlacementMemory()
        self._p_dc = d.prefill_datacenter
        self._p_by_name = {p.name: p for p in self.prefill}
        self._p_index = {p.name: k for k, p in enumerate(self.prefill)}
        self.p_caches = (
            [] if d.p_cache_blocks is None else [DecodeCache(d.p_cache_blocks) for _ in self.prefill]
        )
        self._turn = 0  # placements made: P ties go round, as the router's do (``router.fleet``)
        self._placed = [0] * len(self.decode)  # per MD, requests placed and not over (``router_loads``)
        self._p_rate = [1.0 / max(1e-12, p.model.prefill_s(4096, 0) / 4096) for p in self.prefill]
        self._decode_index = {x.name: i for i, x in enumerate(self.decode)}
        self._wan_bytes = [0] * len(sites)  # measured requests' KV bytes put on each site's line
        # the router's view of each line the router models apart from the line itself (``line_view``)
        self.link_models = [
            None
            if x.seen is None
            else LinkModel(x.seen.wan_bytes_s, x.seen.rtt_s, pool_size=x.seen.pool_size)
            for x in sites
        ]
        self._pending: list[set[str]] = [set() for _ in sites]  # admitted, not on the line yet
        self._report_due = [0.0] * len(sites)
        self._flows = 0

    def _p_batch_holds_rld(self, now: float, compute_s: float) -> None:
        """A P prefill batch on chips RLD shares (``Deployment.rld_shares_p_chips``)."""
        for rld in self.relay:
            rld.stall(now, compute_s)

    # -- arrival and routing -------------------------------------------------------------------

    def run(
        self, requests: Iterable[TraceRequest], warmup_s: float = 0.0, prewarm_s: float = 0.0
    ) -> RunRecords:
        """Simulate ``requests``. Those arriving before ``prewarm_s`` only fill the decode-side caches
        (a cluster in service is warm); those before ``warmup_s`` run but are not measured. The line's
        figures cover the measured window, from ``warmup_s`` to the last arrival."""
        clock, last = self.clock, 0.0
        start: list[LineStats] | None = None
        for r in requests:
            if r.arrival_s < prewarm_s:
                self._prewarm(r)
                continue
            if start is None and r.arrival_s >= warmup_s:
                clock.run(until=warmup_s)
                start = [x.stats(max(warmup_s, x.now)) for x in self.lines]
            clock.run(until=r.arrival_s)
            clock.now = last = r.arrival_s
            self._arrive(r, warmup_s)
        end = [x.stats(max(last, x.now)) for x in self.lines]
        clock.run()
        recs = self.records
        recs.simulated_s = max(last, clock.now)
        recs.measured_s = max(1e-9, last - warmup_s)
        lines = (
            [e - s for e, s in zip(end, start, strict=True)]
            if start is not None
            else [LineStats()] * len(end)
        )
        recs.line = lines[0]
        recs.pool_size = self.line.pool_size
        recs.events = clock.events
        recs.sites = {x.datacenter: line for x, line in zip(self.sites, lines, strict=True)}
        recs.wan_bytes = {x.datacenter: n for x, n in zip(self.sites, self._wan_bytes, strict=True)}
        return recs

    def settle(self, requests: Iterable[TraceRequest], option: Option) -> float:
        """Replay ``requests`` unmeasured with ``option`` forced, as a client naming the pipeline
        does (``pddlink demo``'s warm-up: P->MD, placed by the policy), and run until every one has
        finished. Returns the simulated time then: a later ``run`` starts from it."""
        for r in requests:
            self.clock.run(until=r.arrival_s)
            self.clock.now = max(self.clock.now, r.arrival_s)
            self._arrive(r, math.inf, option)
        self.clock.run()
        return self.clock.now

    def _place(self, r: TraceRequest, hashes: tuple[int, ...], now: float) -> Placement:
        """The router's ``place`` on this instant's state: every P's backlog, every decode
        instance's match in its own DRC, its load and step time, each site's line estimate."""
        d, cap = self.d, self.d.balance_tpot_s
        p_held: list[int | None] = [c.matched_blocks(hashes) for c in self.p_caches]
        p_held = p_held or [None] * len(self.prefill)  # no P caches modelled: unknown
        ps = [
            PSnapshot(p.name, self._p_dc, p.backlog_s(now), rate, matched_blocks=held)
            for p, rate, held in zip(self.prefill, self._p_rate, p_held, strict=True)
        ]
        self._turn += 1
        k = self._turn % len(ps)
        ps = ps[k:] + ps[:k]
        mds = []
        for x, cache, k, placed in zip(self.decode, self.caches, self.md_site, self._placed, strict=True):
            m = cache.matched_blocks(hashes)
            step = x.tpot_s() if cap is not None else 0.0
            site = self.sites[k].datacenter
            running, waiting = (placed, 0) if d.router_loads else (x.load - x.queued, x.queued)
            mds.append(MdSnapshot(x.name, site, m, running, waiting, x.kv_use_fraction, step, True, False,
                                  m))  # fmt: skip
        links: tuple[LinkView, ...] = ()
        if d.crosses_wan:
            links = tuple(
                LinkView(self._p_dc, x.datacenter, self.line_view(k, now)) for k, x in enumerate(self.sites)
            )
        remembered = hashes if self.placement.policy is PlacementPolicy.PREFIX_HASH else ()
        request = PlacementRequest(r.prompt_tokens, self.block_tokens, d.kv_bytes_per_token, remembered)
        got = place(request, FleetView(tuple(ps), tuple(mds), (), links), self.placement, self.memory)
        assert isinstance(got, Placement), got  # every simulated instance is healthy
        return got

    def line_view(self, k: int, now: float) -> LinkEstimate:
        """Site ``k``'s line as the router sees it: the line itself, or (``DecodeSite.seen``) the
        router's own ``LinkModel`` of the line it assumes, fed as the router feeds it: a flow per
        admitted request that ships KV (ended with the request, with P's measure of the transfer
        when it was over by then) and P's transfer state (``BacklogReport``) every
        ``BACKLOG_POLL_S``, lingering transfers of requests already over included."""
        model = self.link_models[k]
        if model is None:
            return self.lines[k].estimate(now)
        if now >= self._report_due[k]:
            shipping = tuple((req.rid, int(n)) for req, n in self.lines[k].in_flight(now) if req.rid)
            model.observe_backlog(BacklogReport(shipping, frozenset(self._pending[k]), now))
            self._report_due[k] = now + BACKLOG_POLL_S
        return model.estimate(now)

    def _ended(self, t: float, req: _Req) -> None:
        """The request is over at the router at ``t``: it leaves the router's counts and link model."""
        if req.rid or self.d.router_loads:
            self.clock.at(t, self._over, req)

    def _over(self, now: float, req: _Req) -> None:
        if self.d.router_loads:
            self._placed[self._decode_index[req.decode.name]] -= 1
        model = self.link_models[self.lines.index(req.line)]
        if model is None or not req.rid:
            return
        done = req.record.kv_transfer_s >= 0  # P's reply (its transfer measure) came before the end
        sent = (
            (req.record.missing_tokens * self.d.kv_bytes_per_token, req.record.kv_transfer_s)
            if done
            else None
        )
        model.finish_flow(req.rid, now, completed=done, sent=sent)

    def _prewarm(self, r: TraceRequest) -> None:
        hashes = r.block_ids[: r.prompt_tokens // self.block_tokens]
        if not (self.d.kind is Kind.PDD and self.d.policy.allows_singular(r.max_tokens)):
            # a request the policy may end on RLD is taken as singular while prewarming (no MD insert)
            # Best match; ties to the emptiest cache, so the warm state is spread as routing would.
            cache = max(self.caches, key=lambda c: (c.matched_blocks(hashes), -len(c.index)))
            cache.index.insert(hashes, r.arrival_s)

    def _arrive(self, r: TraceRequest, warmup_s: float, forced: Option | None = None) -> None:
        """``forced``: the option the client named (no choice, no admission), else the policy's."""
        now = self.clock.now
        b = self.block_tokens
        hashes = r.block_ids[: r.prompt_tokens // b]
        placed = self._place(r, hashes, now)
        i = self._decode_index[placed.md]
        cache = self.caches[i]
        matched = placed.matched_tokens
        p = self._p_by_name[placed.p]
        option, hold_s = (forced, 0.0) if forced else choose(self, r, matched, now, i, p.backlog_s(now))
        rec = Record(r.arrival_s, r.output_tokens, Pipeline.P_MD, measured=r.arrival_s >= warmup_s)
        if self.d.tpot_bound_s is not None:  # the router learns the same from finished requests
            self.outputs.add(r.output_tokens)
        rec.hit = matched / r.prompt_tokens
        rec.decode = placed.md
        rec.missing_tokens = r.prompt_tokens - matched
        self.records.add(rec)
        if option is None:
            rec.rejected = True
            return
        rec.option, rec.pipeline = option, option.pipeline
        self._placed[i] += 1
        tip = cache.reserve(hashes, now) if option is not Option.SINGULAR else None
        lane = self.md_lanes[i] if self.md_lanes else None
        k = self.md_site[i]
        req = _Req(
            r, hashes, rec, self.decode[i], cache, tip, option.pipeline, option,
            self.lines[k], self.sites[k].link, self.back_s[k], lane,
        )  # fmt: skip
        model = self.link_models[k]
        if model is not None and option.ships_kv:  # the router admits the flow; P will ship it
            self._flows += 1
            req.rid = f"r{self._flows}"
            model.start_flow(req.rid, rec.missing_tokens * self.d.kv_bytes_per_token, now)
            self._pending[k].add(req.rid)
        if option.recomputes:  # the token ids cross the WAN; MD prefills what its cache lacks (held
            # while MD's short runs that its stall would push over end: ``hold_for_short_runs``)
            self.clock.at(now + hold_s + req.back_s, self._md_recompute, req)
        if option is not Option.RECOMPUTE:
            p_matched = matched
            if self.p_caches:  # P prefills what its own cache lacks; it holds the prompt afterwards
                req.p_cache = self.p_caches[self._p_index[placed.p]]
                p_matched = min(r.prompt_tokens - 1, req.p_cache.matched_blocks(hashes) * b)
            p.submit(r.prompt_tokens - p_matched, p_matched, now, self._prefilled, req)

    # -- after prefill ---------------------------------------------------------------------------

    def _prefilled(self, now: float, req: _Req) -> None:
        d, rec, r = self.d, req.record, req.trace
        rec.prefill_done_s = now
        if req.p_cache is not None:
            req.p_cache.index.insert(req.hashes, now)
        missing_bytes = rec.missing_tokens * d.kv_bytes_per_token
        if req.pipeline is not Pipeline.P_MD:
            req.rld = self._pick_rld()
            self.clock.at(now + d.link.fast_s(r.prompt_tokens * d.kv_bytes_per_token), self._at_rld, req)
            if req.pipeline is Pipeline.SINGULAR:
                return
        if req.option.recomputes:
            return  # MD prefills the prompt itself (``_md_recompute``): no KV on the WAN
        if self.crosses_wan:
            # P reserved at MD when the request arrived, while it prefilled (``sidecar.prefill``):
            # the suffix goes on the line once both the prefill and the answer are done.
            self.clock.at(max(now, req.record.arrival_s + req.link.rtt_s), self._wan_start, req)
        else:
            self.clock.at(now + d.link.fast_s(missing_bytes), self._kv_at_decode, req)

    def _wan_start(self, now: float, req: _Req) -> None:
        req.wan_start_s = now
        if req.rid:
            self._pending[self.lines.index(req.line)].discard(req.rid)
        nbytes = self._payload_tokens(req) * self.d.kv_bytes_per_token
        if req.record.measured:
            self._wan_bytes[self.lines.index(req.line)] += nbytes
        req.line.send(nbytes, now, self._wan_done, req)

    def _payload_tokens(self, req: _Req) -> int:
        """The tokens whose KV crosses to MD: the missing suffix, or (``Deployment.whole_blocks``)
        every block of the prompt MD lacks, at full size (``sidecar.prefill`` sends whole blocks)."""
        missing = req.record.missing_tokens
        if not self.d.whole_blocks:
            return missing
        b = self.block_tokens
        return -(-req.trace.prompt_tokens // b) * b - (req.trace.prompt_tokens - missing) // b * b

    def _wan_done(self, now: float, req: _Req) -> None:
        req.record.kv_transfer_s = now - req.wan_start_s
        self._land(now, req)
        if req.pipeline is Pipeline.P_RLD_MD:
            self._handoff(now, req)
        else:
            # MD holds the KV; P learns it half a round trip later and hands MD the first token
            # (``first_token_to_md``), which crosses in another half: MD starts then.
            self.clock.at(now + req.link.rtt_s, self._kv_at_decode, req)

    # -- recompute on MD -------------------------------------------------------------------------

    def _md_recompute(self, now: float, req: _Req) -> None:
        assert req.md_lane is not None
        rec = req.record
        matched = req.trace.prompt_tokens - rec.missing_tokens
        req.md_lane.submit(rec.missing_tokens, matched, now, self._recomputed, req)

    def _recomputed(self, now: float, req: _Req) -> None:
        if req.option is Option.RECOMPUTE:
            self._kv_at_decode(now, req)
            return
        self._land(now, req)
        req.md_ready = True
        if req.rld_seq is not None or req.rld_done:
            self._handoff(now, req)

    # -- decode on D / MD ------------------------------------------------------------------------

    def _kv_at_decode(self, now: float, req: _Req, tokens: int | None = None) -> None:
        self._land(now, req)
        n = req.trace.output_tokens if tokens is None else tokens
        seq = DecodeSeq(n, req.trace.prompt_tokens + n, self._decode_done, req, self._md_first_token)
        req.decode.admit(seq, now)

    def _md_first_token(self, t: float, req: _Req) -> None:
        rec = req.record
        back = req.back_s
        if rec.first_token_s < 0:
            rec.first_token_s = t + back
        rec.md_start_s = t + back

    def _decode_done(self, now: float, req: _Req) -> None:
        rec = req.record
        rec.finish_s = now + req.back_s
        self._ended(rec.finish_s, req)
        rec.md_tokens = req.trace.output_tokens - rec.rld_tokens
        self.finished.add(req.trace.output_tokens, rec.rld_tokens, self._missed_tpot(rec, req))
        self._release(req)

    def _missed_tpot(self, rec: Record, req: _Req) -> bool:
        """A finished request's TPOT past the deployment's bound (what the router's book records)."""
        if rec.first_token_s < 0:
            return False
        return missed_tpot(rec.first_token_s, rec.finish_s, req.trace.output_tokens, self.d.tpot_bound_s)

    def _land(self, now: float, req: _Req) -> None:
        """MD holds the prompt's KV: it enters MD's DRC (pinned while the sequence runs)."""
        if not req.landed:
            req.landed = True
            req.tip = req.cache.land(req.hashes, req.tip, now)

    def _release(self, req: _Req) -> None:
        if not req.released:
            req.released = True
            req.cache.release(req.tip)

    # -- RelayDecode -------------------------------------------------------------------------------

    def _pick_rld(self) -> DecodeInstance:
        """The router's RLD choice (``choose_rld``: the least loaded), when P's KV is out."""
        name = choose_rld(tuple(RldSnapshot(x.name, self._p_dc, x.load) for x in self.relay))
        return next(x for x in self.relay if x.name == name)

    def _at_rld(self, now: float, req: _Req) -> None:
        assert req.rld is not None
        if req.md_ready:  # MD recomputed the prompt before RLD even started: MD decodes it all
            self._kv_at_decode(now, req)
            return
        seq = DecodeSeq(
            req.trace.output_tokens, req.trace.prompt_tokens, self._rld_finished, req, self._rld_first
        )
        req.rld_seq = seq
        req.rld.admit(seq, now)

    def _rld_first(self, t: float, req: _Req) -> None:
        if req.record.first_token_s < 0:
            req.record.first_token_s = t

    def _rld_finished(self, now: float, req: _Req) -> None:
        rec = req.record
        req.rld_done = True
        rec.rld_tokens = req.trace.output_tokens
        rec.finish_s = now
        self._ended(now, req)
        self.finished.add(req.trace.output_tokens, rec.rld_tokens, self._missed_tpot(rec, req))
        if req.pipeline is Pipeline.SINGULAR:
            return
        if rec.kv_transfer_s >= 0 or req.md_ready:  # catch-up was under way; MD already has the KV
            self._release(req)

    def _handoff(self, now: float, req: _Req) -> None:
        rld, seq = req.rld, req.rld_seq
        if req.rld_done or rld is None or seq is None:
            self._release(req)  # finished on RLD before the KV landed; MD caches it all the same
            return
        load = rld.load / rld.max_seqs
        decision = choose_handoff_mode(load, self.d.policy)
        rec = req.record
        rec.handoff = decision.mode
        md_model = req.decode.model
        if decision.mode is HandoffMode.ONE_SHOT:
            produced = rld.remove(seq, now)
            self._to_md(now + md_model.extend_s(produced), req, produced)
        else:
            # RLD keeps decoding while MD extends what it has; MD is level one iteration later.
            self.clock.at(now + md_model.extend_s(rld.generated(seq, now)), self._catch_up_done, req)

    def _catch_up_done(self, now: float, req: _Req) -> None:
        rld, seq = req.rld, req.rld_seq
        assert rld is not None and seq is not None
        if req.rld_done:
            return
        produced = rld.remove(seq, now)
        self._to_md(now + req.decode.tpot_s(), req, produced)

    def _to_md(self, t: float, req: _Req, produced: int) -> None:
        rec = req.record
        rec.rld_tokens = produced
        rest = req.trace.output_tokens - produced
        if rest <= 0:
            rec.finish_s = t
            self._ended(t, req)
            self._release(req)
            return
        self.clock.at(t, lambda now, r: self._kv_at_decode(now, r, rest), req)
