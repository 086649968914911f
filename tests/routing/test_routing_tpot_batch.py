"""The router's time-per-token book conditioned on how many requests share the instance: it fits
``tpot = a + b * running`` to finished requests (their TPOT and the requests in flight on their MD
when they were admitted), so the TPOT bound judges a new request by MD's load now, not by the mean
of whatever finished lately."""

from __future__ import annotations

import pytest

from pddlink.routing import LinkEstimate, MdPrefill, Option, OptionInputs, RejectReason, choose_option
from pddlink.routing.books import BATCH_MIN_SAMPLES, StallLedger, TpotBook
from pddlink.routing.outputs import OutputLengths
from tests.routing.test_routing_options import LINE, PDD_RECOMPUTE, routing

BOUND = 0.010


def finished(tpot_s: float, running: int | None, n: int = 101, source: str = "md") -> dict[str, object]:
    trace: dict[str, object] = {
        "outcome": "finished",
        "tokens": {source: n},
        "ttft_s": 0.1,
        "e2e_s": 0.1 + tpot_s * (n - 1),
        "output_tokens": n,
    }
    if running is not None:
        trace[f"{source}_running"] = running
    return trace


def loaded_book(base: float = 0.005, per_request: float = 0.0015, rounds: int = 6) -> TpotBook:
    book = TpotBook(0.008)
    for _ in range(rounds):
        for running in range(6):
            book.observe(finished(base + per_request * running, running))
    return book


def test_the_book_fits_tpot_against_the_requests_in_flight() -> None:
    book = loaded_book()
    slope = book.per_request_s()
    assert slope == pytest.approx(0.0015, rel=1e-6)
    assert book.estimate(4) == pytest.approx(0.011, rel=1e-6)
    assert book.estimate(1) == pytest.approx(0.0065, rel=1e-6)
    # the mean of what finished says neither: it sits between
    assert book.estimate(1) < book.tpot_s < book.estimate(4)


def test_without_spread_or_samples_the_mean_stands() -> None:
    book = TpotBook(0.008)
    for _ in range(BATCH_MIN_SAMPLES - 1):
        book.observe(finished(0.012, 2))
    assert book.per_request_s() is None and book.estimate(2) == book.tpot_s  # too few
    flat = TpotBook(0.008)
    for _ in range(40):
        flat.observe(finished(0.012, 3))  # always 3 in flight: no spread to fit a slope on
    assert flat.per_request_s() is None and flat.estimate(5) == flat.tpot_s
    untold = TpotBook(0.008)
    for running in range(40):
        untold.observe(finished(0.004 + 0.001 * (running % 5), None))  # no in-flight count in the trace
    assert untold.per_request_s() is None


def test_a_slower_instance_under_less_load_never_fits_a_negative_slope() -> None:
    book = TpotBook(0.008)
    for _ in range(5):
        for running in range(5):
            book.observe(finished(0.012 - 0.001 * running, running))
    assert book.per_request_s() == 0.0
    assert book.estimate(4) == pytest.approx(book.estimate(1))


def test_rld_book_reads_rld_running_and_idle_stays_capped() -> None:
    rld = TpotBook(0.008, source="rld")
    for _ in range(4):
        for running in range(4):
            rld.observe(finished(0.006 + 0.002 * running, running, source="rld"))
            rld.observe(finished(0.05, running))  # MD's request: not RLD's pace
    assert rld.per_request_s() == pytest.approx(0.002, rel=1e-6)
    assert rld.estimate(0) <= 0.008  # idle: at most its unloaded figure


def _inputs(book: TpotBook, md_running: int) -> OptionInputs:
    busy = LinkEstimate(LINE, 0.02, flows_in_flight=10, backlog_bytes=40_000_000)
    return OptionInputs(
        routing(link=busy),
        deadline_s=18.0,
        ttft_deadline_s=2.0,
        md_prefill=MdPrefill(tokens_per_s=4000.0),
        md_tpot_s=book.estimate(md_running),
        tpot_bound_s=BOUND,
        md_running=md_running,
        md_outputs=OutputLengths.of([300] * 20),  # a 0.19 s stall adds 0.6 ms per token to each
    )


def test_the_bound_refuses_at_a_full_md_and_admits_at_a_quiet_one_after_a_busy_spell() -> None:
    book = loaded_book()
    # lately requests finished at 8.75 ms on average, above 0.9 x the bound: judged by that mean,
    # every recompute pushed someone over; judged by MD's load now, a quiet MD recomputes
    assert book.tpot_s > 0.9 * BOUND
    quiet = choose_option(_inputs(book, 1), PDD_RECOMPUTE)
    assert quiet.option is not None and quiet.option.recomputes  # RLD streams while MD prefills
    full = choose_option(_inputs(book, 5), PDD_RECOMPUTE)  # 12.5 ms per token once it joins
    assert full.option is None and full.reason is RejectReason.TPOT_UNREACHABLE
    assert all(e.tpot_s > BOUND for e in full.estimates if e.option is not Option.SINGULAR)


def test_recompute_stalls_are_taken_out_of_what_the_book_learns() -> None:
    """MD decoding at 5 ms per token while other prompts' recomputes held it still for 0.3 s of a
    101-token request's decode: the request saw 8 ms per token, the book learns 5 ms (the bound
    charges each new stall on top of it; learning 8 ms charged the old ones again)."""
    stalled, clean = TpotBook(0.005), TpotBook(0.005)
    for _ in range(60):
        trace = finished(0.005 + 0.3 / 100, 2)
        stalled.observe(trace)
        clean.observe({**trace, "md_stall_s": 0.3})
    assert stalled.tpot_s == pytest.approx(0.008, rel=1e-3)
    assert clean.tpot_s == pytest.approx(0.005, rel=1e-3)
    rld = TpotBook(0.005, source="rld")  # RLD's book has no MD stalls to take out
    rld.observe({**finished(0.008, 2, source="rld"), "md_stall_s": 0.3})
    assert rld.tpot_s > 0.005


def test_the_ledger_sums_each_instances_recompute_time() -> None:
    ledger = StallLedger()
    ledger.add("md0", 0.2)
    ledger.add("md1", 0.5)
    ledger.add("md0", 0.1)
    ledger.add("md0", -1.0)  # nothing to add: a ready event without a prefill time
    assert ledger.total("md0") == pytest.approx(0.3)
    assert ledger.total("md1") == pytest.approx(0.5)
    assert ledger.total("md2") == 0.0


def test_rld_without_a_fit_of_its_own_borrows_mds_slope() -> None:
    md = loaded_book(base=0.005, per_request=0.0015)
    rld = TpotBook(0.006, source="rld")
    for _ in range(3):  # a few relays RLD finished, alone: no spread to fit
        rld.observe(finished(0.006, 0, source="rld"))
    assert rld.per_request_s() is None
    slope = md.per_request_s()
    assert rld.estimate(4) == pytest.approx(0.006)  # flat without a prior
    assert rld.estimate(4, prior_per_request_s=slope) == pytest.approx(0.006 + 4 * 0.0015)
    assert rld.estimate(0, prior_per_request_s=slope) == pytest.approx(0.006)
    fitted = loaded_book(base=0.004, per_request=0.0005)  # a fit of its own wins over the prior
    assert fitted.estimate(4, prior_per_request_s=0.01) == pytest.approx(0.006)
