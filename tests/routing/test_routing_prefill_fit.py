"""The prefill book's cost model: ``seconds = fixed + tokens / rate`` fitted to what the replies
report (``LineFit``, the fit ``TpotBook`` uses too), so small prefills' fixed cost no longer drags
the rate used for large ones; the mean rate stands until the fit holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.errors import InvalidInput
from pddlink.routing.books import PREFILL_MIN_SAMPLES, LineFit, PrefillBook

FIXED, RATE = 0.012, 3700.0  # MD in wan-overload: ~12 ms whatever the length, ~3,700 tokens/s


def measured(tokens: int) -> float:
    return FIXED + tokens / RATE


def wan_overload_md() -> PrefillBook:
    """Small recomputes (17-42 tokens) among a few large ones, as MD saw them in wan-overload."""
    book = PrefillBook(3700.0)
    for i in range(40):
        tokens = 644 if i % 5 == 4 else 17 + (i * 7) % 26
        book.start(f"r{i}", tokens)
        book.ready(f"r{i}", tokens, measured(tokens))
    return book


def test_small_recomputes_no_longer_double_a_large_prefills_estimate() -> None:
    book = wan_overload_md()
    # what the old mean of tokens / seconds made of it: ~2,000 tokens/s, 644 tokens at ~0.3 s
    assert book.tokens_per_s < 2600
    assert 644 / book.tokens_per_s > 1.4 * measured(644)
    est = book.estimate()
    assert est.ready_s(644) == pytest.approx(measured(644), rel=0.02)
    assert est.ready_s(20) == pytest.approx(measured(20), rel=0.02)
    assert est.fixed_s == pytest.approx(FIXED, rel=0.05) and est.tokens_per_s == pytest.approx(RATE, rel=0.05)
    assert book.prefill_s(644) == pytest.approx(measured(644), rel=0.02) and book.prefill_s(0) == 0.0


def test_queued_prefills_each_pay_the_fixed_cost() -> None:
    book = wan_overload_md()
    book.start("a", 100)
    book.start("b", 300)
    assert book.queued_tokens == 400
    assert book.queue_s() == pytest.approx(2 * FIXED + 400 / RATE, rel=0.03)
    assert book.estimate().queue_s == pytest.approx(book.queue_s())
    book.finish("a")
    assert book.queue_s() == pytest.approx(measured(300), rel=0.03)


def test_the_mean_rate_stands_until_enough_prefills_of_spread_lengths() -> None:
    book = PrefillBook(3300.0)
    for i in range(PREFILL_MIN_SAMPLES * 3):  # many, all the same length: no spread to fit
        book.ready(f"r{i}", 500, measured(500))
    assert book.cost() == (0.0, book.tokens_per_s)
    assert book.prefill_s(500) == pytest.approx(500 / book.tokens_per_s)
    few = PrefillBook(3300.0)
    for i, tokens in enumerate((20, 600, 30)):  # spread, but too few
        few.ready(f"r{i}", tokens, measured(tokens))
    assert few.cost()[0] == 0.0 and few.estimate().fixed_s == 0.0


def test_a_fit_with_a_negative_intercept_goes_through_the_origin() -> None:
    fit = LineFit(1 / 32, 4, 1.0)
    for x in (100.0, 200.0, 400.0, 800.0):
        fit.add(x, x / 1000 - 0.01)  # a = -10 ms: no prefill costs less than nothing
    free = fit.line()
    assert free is not None and free[0] == pytest.approx(-0.01)
    a, b = fit.line(nonnegative_intercept=True) or (None, None)
    assert a == 0.0 and b is not None and 0 < b < 1 / 1000


def test_a_falling_line_is_flat_and_bad_settings_are_refused() -> None:
    fit = LineFit(0.5, 2, 0.5)
    fit.add(1.0, 5.0)
    fit.add(3.0, 1.0)
    line = fit.line()
    assert line is not None and line[1] == 0.0
    for weight, n, var in ((0.0, 8, 1.0), (0.5, 1, 1.0), (0.5, 8, 0.0)):
        with pytest.raises(InvalidInput):
            LineFit(weight, n, var)


@settings(max_examples=60, deadline=None)
@given(
    fixed=st.floats(0.0, 0.05),
    rate=st.floats(500.0, 20000.0),
    lengths=st.lists(st.integers(1, 4096), min_size=PREFILL_MIN_SAMPLES, max_size=60),
)
def test_the_fit_recovers_any_fixed_cost_and_rate(fixed: float, rate: float, lengths: list[int]) -> None:
    book = PrefillBook(1000.0)
    for i, tokens in enumerate(lengths):
        book.ready(f"r{i}", tokens, fixed + tokens / rate)
    got_fixed, got_rate = book.cost()
    recovered = got_fixed == pytest.approx(fixed, abs=1e-6) and got_rate == pytest.approx(rate, rel=1e-4)
    if not recovered and got_fixed == 0.0 and got_rate == book.tokens_per_s:  # no fit: the mean stands
        mean = sum(lengths) / len(lengths)
        assert sum((t - mean) ** 2 for t in lengths) / len(lengths) < 64.0**2 * 1.01
        return
    assert got_fixed == pytest.approx(fixed, abs=1e-6) and got_rate == pytest.approx(rate, rel=1e-4)
    assert book.prefill_s(1000) == pytest.approx(fixed + 1000 / rate, rel=1e-4)
