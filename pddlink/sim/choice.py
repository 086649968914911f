"""The simulated router's choice: the real ``choose_option`` on the simulation's state at one
instant, as a router would see it there (the line with its backlog, P's queue, MD's prefill lane and
the runs it decodes, RLD's load, the output book), and how long the chosen option's start is held
(``OptionDecision.hold_s``). ``pddlink.sim.engine.Simulation`` calls it on each arrival."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from pddlink.routing import (
    MdPrefill,
    MdRun,
    Option,
    OptionInputs,
    Pipeline,
    RoutingInputs,
    choose_option,
    choose_pipeline,
)
from pddlink.sim.deploy import Kind
from pddlink.sim.md_lane import MdPrefillLane
from pddlink.sim.resources import DecodeInstance
from pddlink.sim.trace import TraceRequest

if TYPE_CHECKING:
    from pddlink.sim.engine import Simulation

SHIPPING_OPTION = {
    Pipeline.P_MD: Option.SHIP,
    Pipeline.P_RLD_MD: Option.RELAY,
    Pipeline.SINGULAR: Option.SINGULAR,
}


def choose(
    sim: Simulation, r: TraceRequest, matched: int, now: float, i: int, p_backlog_s: float
) -> tuple[Option | None, float]:
    """The option for ``r`` on decode instance ``i`` and how long its start is held. Deployments
    without RLD nor a deadline always ship."""
    d = sim.d
    if not d.crosses_wan or (d.kind is not Kind.PDD and d.deadline_s is None):
        return Option.SHIP, 0.0
    policy = d.policy if d.kind is Kind.PDD else replace(d.policy, relay_enabled=False)
    active, tpot = 0, math.inf
    for x in sim.relay:
        active += x.load
        t = x.tpot_s()
        if t < tpot:
            tpot = t
    routing = RoutingInputs(
        prompt_tokens=r.prompt_tokens,
        matched_tokens=matched,
        kv_bytes_per_token=d.kv_bytes_per_token,
        max_output_tokens=r.max_tokens,
        link=sim.line_view(sim.md_site[i], now),
        rld_available=bool(sim.relay),
        rld_active=active,
        rld_capacity=max(1, sim.rld_capacity),
        rld_tpot_s=tpot if math.isfinite(tpot) else 0.03,
    )
    if d.deadline_s is None and not sim.md_lanes and policy.rld_token_budget >= 1:
        # no deadline, no recompute, no RLD budget: ``choose_option`` is exactly ``choose_pipeline``
        # (a property test says so), which is cheaper: the calibrated scenarios run millions of these
        return SHIPPING_OPTION[choose_pipeline(routing, policy).pipeline], 0.0
    missing = r.prompt_tokens - matched
    p_model, md = sim.prefill[0].model, sim.decode[i]
    md_prefill = None
    if sim.md_lanes:
        md_prefill = md_prefill_view(sim.md_lanes[i], missing, matched, now)
    inputs = OptionInputs(
        routing,
        deadline_s=d.deadline_for(r.max_tokens),
        ttft_deadline_s=d.ttft_deadline_s,
        p_prefill_s=p_backlog_s + p_model.fig.prefill_batch_s + p_model.prefill_s(missing, matched),
        fast_s=d.link.fast_s(r.prompt_tokens * d.kv_bytes_per_token),
        md_prefill=md_prefill,
        # chunked: MD's decode speed, its prefill queue (``md_prefill``) says what slows it
        md_tpot_s=md.base_step_s() if d.md_chunk_tokens is not None else md.tpot_s(),
        extend_s=md.model.extend_s(16),
        tpot_bound_s=d.tpot_bound_s,
        md_running=md.running,
        md_outputs=sim.outputs.lengths(),
        md_runs=md_runs(md, now) if d.tpot_bound_s is not None else (),
        rld_token_share=sim.finished.rld_share(),
        rld_miss_share=sim.finished.relay_miss_share(),
    )
    decision = choose_option(inputs, policy)
    return decision.option, decision.hold_s


def md_runs(md: DecodeInstance, now: float) -> tuple[MdRun, ...]:
    """The requests ``md`` decodes now as a router knows them: output bound and tokens so far."""
    out = []
    for arg, done in md.running_progress(now):
        trace = getattr(arg, "trace", None)  # the simulation's request (``engine._Req``)
        if isinstance(trace, TraceRequest):
            out.append(MdRun(trace.max_tokens, min(done, trace.max_tokens)))
    return tuple(out)


def md_prefill_view(lane: MdPrefillLane, missing: int, matched: int, now: float) -> MdPrefill:
    """MD's recompute as the policy sees it: the headroom lane's effective speed, or (chunked)
    its full speed with the per-step budget, which ``MdPrefill`` spreads over decode steps."""
    work = lane.work_s(missing, matched)
    if lane.chunk_tokens is not None:
        return MdPrefill(missing / max(work, 1e-9), lane.backlog_s(now), lane.chunk_tokens)
    return MdPrefill(missing / max(work / lane.share(), 1e-9), lane.backlog_s(now))
