"""The router's choice under the SLO: ``router.options`` feeds ``choose_option`` the TPOT bound, MD's
running requests and the short outputs it learned, and a request no option serves within the SLO is
refused at once, typed (``Overloaded``), before any sidecar is contacted. The sidecars' addresses
lead nowhere: a request the router admitted would fail, one it refuses never tries."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from engines_adapter import SamplingParams
from pddlink.routing import MdRun, Option, RejectReason
from router import Router, RouterConfig
from router.admission import Overloaded
from router.answer import GenerateEvent
from router.options import option_inputs

PROMPT = list(range(1, 769))  # 768 tokens, nothing cached on MD: 0.77 s of MD prefill at 1000 tok/s


def config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = dict(
        p="127.0.0.1:9",
        rld="127.0.0.1:10",
        md="127.0.0.1:11",
        line_mbit=0.5,  # the suffix's KV (1.5 MB) needs 25 s: shipping misses the deadline's WAN share
        relay_enabled=False,
        md_prefill_tokens_per_s=1000.0,
        md_tpot_s=0.015,
    )
    base.update(kw)
    return RouterConfig(**base)


def in_router(cfg: RouterConfig, body: Any) -> Any:
    async def main() -> Any:
        router = Router(cfg)
        try:
            return await body(router)
        finally:
            await router.close()

    return asyncio.run(main())


async def first_event(router: Router, max_tokens: int = 64) -> GenerateEvent:
    gen = router.generate(PROMPT, SamplingParams(max_tokens=max_tokens), deadline_s=30.0)
    return await anext(gen)  # refused here, before any sidecar is contacted


@pytest.mark.timeout(30)
def test_without_an_slo_the_router_recomputes_on_md() -> None:
    async def body(router: Router) -> None:
        decision, matched = router.decide(tuple(PROMPT), 64, "", 30.0)
        assert matched == 0 and decision.option is Option.RECOMPUTE

    in_router(config(), body)


def one_running(router: Router) -> None:
    """MD decodes one request (an idle MD pushes nobody over the bound)."""
    router.fleet.begin(router.fleet.place(tuple(PROMPT), time.monotonic()), relayed=False)


@pytest.mark.timeout(30)
def test_recompute_that_breaks_the_tpot_slo_is_refused_at_once_typed() -> None:
    async def body(router: Router) -> None:
        one_running(router)
        inputs = option_inputs(router, *_routing(router), md_running=1)
        assert (
            inputs.tpot_bound_s == pytest.approx(0.02) and inputs.md_outputs.token_share_below(2.0) == 1.0
        )  # none known
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as info:
            await first_event(router)
        assert time.monotonic() - t0 < 2.0  # refused at once, not after the sidecars' timeouts
        assert info.value.reason is RejectReason.TPOT_UNREACHABLE
        assert "TPOT SLO" in info.value.message and info.value.retry_after_s >= 1.0
        assert router.in_flight == {} and router.md_book.queued_tokens == 0

    in_router(config(slo_tpot_ms=20.0), body)


@pytest.mark.timeout(30)
def test_long_outputs_learned_spread_the_stall_within_the_bound() -> None:
    async def body(router: Router) -> None:
        assert router.decide(tuple(PROMPT), 64, "", 30.0)[0].option is Option.RECOMPUTE  # MD idle
        one_running(router)
        assert router.decide(tuple(PROMPT), 64, "", 30.0)[0].option is None
        for _ in range(50):  # finished requests of 400 tokens: 0.77 s pushes none over (1.9 ms each)
            router.outputs.add(400)
        decision, _ = router.decide(tuple(PROMPT), 64, "", 30.0)
        assert decision.option is Option.RECOMPUTE
        est = decision.estimate(Option.RECOMPUTE)
        assert est is not None and est.md_batch_tpot_s == pytest.approx(0.015 + 0.768 / 400, rel=0.01)

    in_router(config(slo_tpot_ms=20.0), body)


@pytest.mark.timeout(30)
def test_a_ttft_slo_no_option_meets_is_refused_as_a_deadline() -> None:
    async def body(router: Router) -> None:
        with pytest.raises(Overloaded) as info:
            await first_event(router)
        assert info.value.reason is RejectReason.DEADLINE_UNREACHABLE

    in_router(config(slo_ttft_ms=300.0), body)


@pytest.mark.timeout(30)
def test_md_running_is_what_the_fleet_counts_on_that_md() -> None:
    async def body(router: Router) -> None:
        route = router.fleet.place(tuple(PROMPT), time.monotonic())
        router.fleet.begin(route, relayed=False)
        router.fleet.begin(route, relayed=False)
        routing, deadline = _routing(router)
        assert option_inputs(router, routing, deadline, router.fleet.running[route.md.name]).md_running == 2

    in_router(config(slo_tpot_ms=20.0), body)


@pytest.mark.timeout(30)
def test_a_run_on_md_bounded_short_counts_as_pushed_over_by_a_recompute() -> None:
    """768 tokens at 1000 tok/s stall MD 0.77 s; with 3 ms of headroom that breaks requests under
    256 tokens. The outputs learned are long (the share sees nobody that short), but the run on MD
    asked for 8 tokens: the router passes its bound and the recompute counts it (so RLD serves this
    request instead)."""

    async def body(router: Router) -> None:
        for _ in range(10):
            router.outputs.add(5000)
        route = router.fleet.place(tuple(PROMPT), time.monotonic())
        router.fleet.begin(route, relayed=False)
        router.routes["short"], router.bounds["short"] = route, 8  # what a run registers on its MD
        router.produced["short"] = 3  # tokens it streamed so far
        assert router.md_runs(route.md.name) == (MdRun(8, 3),) and router.md_runs("elsewhere") == ()
        router.produced["short"] = 0  # 8 tokens to go at 15 ms: 120 ms, too long to hold for
        decision, _ = router.decide(tuple(PROMPT), 64, "", 30.0)
        rec = decision.estimate(Option.RECOMPUTE)
        assert rec is not None and rec.md_pushed_over == pytest.approx(1.0)
        assert decision.option is not Option.RECOMPUTE
        router.bounds["short"] = 5000
        decision, _ = router.decide(tuple(PROMPT), 64, "", 30.0)
        rec = decision.estimate(Option.RECOMPUTE)
        assert rec is not None and rec.md_pushed_over == 0.0

    in_router(config(slo_tpot_ms=20.0, relay_enabled=True), body)  # it counts where RLD could serve


@pytest.mark.timeout(30)
def test_a_held_recompute_waits_counted_in_mds_queue_and_leaves_nothing_when_cancelled() -> None:
    """MD decodes at 4 ms a token against a 10 ms bound: the 0.77 s recompute breaks runs under 153
    tokens, and the one on MD asked for 8, which ends within 32 ms: the router holds the recompute
    that long, with its prefill in MD's queue meanwhile, and sends nothing before the hold ends."""

    async def body(router: Router) -> None:
        for _ in range(10):
            router.outputs.add(5000)
        route = router.fleet.place(tuple(PROMPT), time.monotonic())
        router.fleet.begin(route, relayed=False)
        router.routes["short"], router.bounds["short"] = route, 8
        decision, _ = router.decide(tuple(PROMPT), 64, "", 30.0)
        assert decision.option is Option.RECOMPUTE and decision.hold_s == pytest.approx(0.032)
        # cancelled while held: MD's queue no longer counts it
        gen = router.generate(PROMPT, SamplingParams(max_tokens=64), deadline_s=30.0)
        held = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.01)
        assert router.md_book.queued_tokens == len(PROMPT) and not router.in_flight
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        await gen.aclose()
        assert router.md_book.queued_tokens == 0
        # run to its end (the sidecars lead nowhere): sent only after the hold
        events = [e async for e in router.generate(PROMPT, SamplingParams(max_tokens=64), deadline_s=2.0)]
        stamps = events[-1].trace["stamps_s"]  # type: ignore[union-attr]
        assert stamps["held"] - stamps["placed"] >= 0.032 and stamps["sent"] >= stamps["held"]

    in_router(config(slo_tpot_ms=10.0, md_tpot_s=0.004), body)


def test_negative_slo_is_refused() -> None:
    from pddlink.errors import InvalidInput

    with pytest.raises(InvalidInput, match="slo_tpot_ms"):
        config(slo_tpot_ms=-1.0)


def _routing(router: Router) -> tuple[Any, float]:
    from pddlink.routing import RoutingInputs

    route = router.fleet.place(tuple(PROMPT), time.monotonic())
    routing = RoutingInputs(
        prompt_tokens=len(PROMPT),
        matched_tokens=0,
        kv_bytes_per_token=router.cfg.kv_bytes_per_token,
        max_output_tokens=64,
        link=route.link.estimate(time.monotonic()),
        rld_available=False,
    )
    return routing, 30.0


def test_tpot_books_learn_each_instance_from_the_requests_it_alone_decoded() -> None:
    from pddlink.routing.books import TpotBook

    md, rld = TpotBook(0.008), TpotBook(0.008, source="rld")
    slow = {"outcome": "finished", "ttft_s": 0.1, "e2e_s": 2.1, "output_tokens": 101}  # 20 ms per token
    md.observe({**slow, "tokens": {"md": 101}})
    rld.observe({**slow, "tokens": {"md": 101}})  # not RLD's pace
    assert md.tpot_s == pytest.approx(0.8 * 0.008 + 0.2 * 0.02) and rld.tpot_s == 0.008
    rld.observe({**slow, "tokens": {"rld": 101}})
    md.observe({**slow, "tokens": {"rld": 60, "md": 41}})  # handed off: neither's pace alone
    assert rld.tpot_s == md.tpot_s > 0.008
    # busy: what finished requests saw; idle: at most the unloaded figure it started from
    assert md.estimate(running=3) == md.tpot_s and md.estimate(running=0) == 0.008


@pytest.mark.timeout(30)
def test_an_md_too_slow_for_the_bound_takes_requests_again_once_idle() -> None:
    async def body(router: Router) -> None:
        for _ in range(30):
            router.outputs.add(400)
            router.md_tpot.observe(
                {
                    "outcome": "finished",
                    "tokens": {"md": 101},
                    "ttft_s": 0.1,
                    "e2e_s": 3.1,
                    "output_tokens": 101,
                }
            )
        assert router.md_tpot.tpot_s > 0.02  # MD was seen at 30 ms per token: over the bound
        routing, deadline = _routing(router)
        busy = option_inputs(router, routing, deadline, md_running=2)
        idle = option_inputs(router, routing, deadline, md_running=0)
        assert busy.md_tpot_s > 0.02 and idle.md_tpot_s == 0.015
        assert router.decide(tuple(PROMPT), 64, "", 30.0)[0].option is Option.RECOMPUTE  # idle now

    in_router(config(slo_tpot_ms=20.0), body)
