"""The rolling-restart demo's bookkeeping, in memory (``harness.rolling``, ``harness.rolling_report``):
a request is hung only past its deadline or cut by the client's own timeout; a restart's row counts
what was in flight at SIGTERM (on the restarted process too) and what ran until it served again;
the tables and the timeline render from the documents."""

from __future__ import annotations

from pathlib import Path

from harness.demo_load import RequestResult
from harness.rolling import RestartStep, Timed, load_figures, step_figures, timed
from harness.rolling_report import plot_timeline, table_outage, table_rolling

STEP = RestartStep("md-b0", "md", term_s=10.0, exit_s=12.0, exit_code=0, ready_s=15.0, serving_s=16.0)


def _t(i: int, a: float, b: float, outcome: str = "finished", md: str = "md-b1", reason: str = "") -> Timed:
    return Timed(i, a, b, outcome, reason, False, {"md": md, "router": "router0"})


def test_hung_means_past_the_deadline_or_the_clients_timeout() -> None:
    ok = RequestResult(0, e2e_s=40.0, outcome="finished")
    assert not timed(ok, 1.0, deadline_s=30.0).hung  # slow but finished
    late = RequestResult(1, e2e_s=36.0, outcome="failed", reason="the stream ended without its last chunk")
    assert timed(late, 1.0, deadline_s=30.0).hung
    cut = RequestResult(2, e2e_s=3.0, outcome="failed", reason="ReadTimeout: timed out")
    assert timed(cut, 1.0, deadline_s=30.0).hung
    typed = RequestResult(3, e2e_s=2.0, outcome="failed", reason="HTTP 503: stopping")
    assert not timed(typed, 1.0, deadline_s=30.0).hung


def test_timed_names_where_the_request_ran() -> None:
    trace = {"placement": {"p": "p-a0", "md": "md-b1", "rld": None}, "request_key": "router1-9f3a"}
    got = timed(RequestResult(4, e2e_s=1.0, outcome="finished", tokens=[5, 6], trace=trace), 2.0, 30.0)
    assert got.where == {"p": "p-a0", "md": "md-b1", "router": "router1"} and got.tokens == (5, 6)
    assert (got.sent_s, got.ended_s) == (2.0, 3.0)


def test_a_restarts_row() -> None:
    load = [
        _t(0, 1.0, 5.0),  # before: not counted
        _t(1, 8.0, 11.0, md="md-b0"),  # in flight at SIGTERM, on it, finished
        _t(2, 9.0, 13.0),  # in flight at SIGTERM, elsewhere
        _t(3, 12.0, 12.5, "failed", reason="HTTP 503: stopping"),  # during, failed
        _t(4, 17.0, 18.0),  # after it served again
    ]
    row = step_figures(STEP, load)
    assert (row["in_flight_at_term"], row["in_flight_on_it"], row["in_flight_on_it_finished"]) == (2, 1, 1)
    assert (row["during"], row["finished"], row["failed"]) == (3, 2, 1)
    assert row["failure_reasons"] == {"HTTP 503: stopping": 1} and row["down_s"] == 6.0
    router = RestartStep("router", "router", 10.0, 11.0, None, 13.0, 14.0)
    assert step_figures(router, load)["in_flight_on_it"] == 2  # router0's requests (process "router")


def test_the_tables_and_the_timeline_render(tmp_path: Path) -> None:
    load = [_t(0, 1.0, 5.0), _t(1, 8.0, 11.0, "failed", reason="MD lost")]
    figures = load_figures(load, mismatches=0)
    assert (figures["failed"], figures["failed_share"], figures["failure_reasons"]) == (
        1,
        0.5,
        {"MD lost": 1},
    )
    doc = {"restarts": [step_figures(STEP, load)], "load": figures, "span_s": 11.0, "plot": "x.png"}
    assert "md-b0" in table_rolling(doc) and "1x MD lost" in table_rolling(doc)
    during = {"requests": 1, "failed": 0, "on_joined_md": 1, "by_md": {"md-joined0": 1}}
    outage = {
        "baseline": figures, "outage": figures, "during_outage": during, "joined_md": "md-joined0",
        "stale_seen": {"router": 1.0}, "extra_failed": 0, "plot": "y.png",
    }  # fmt: skip
    assert "router 100%" in table_outage(outage)
    png = tmp_path / "t.png"
    plot_timeline(load, [("md-b0", 10.0, 16.0)], png, "test")
    assert png.stat().st_size > 10_000
