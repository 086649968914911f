"""P's account of what is queued toward MD, the router's reading of it, MD's prefill book, and
the congestion label: in memory, no sockets."""

from __future__ import annotations

import json

import pytest

from pddlink.errors import InvalidInput
from pddlink.routing import LinkModel, Option
from pddlink.routing.books import PrefillBook, RecomputeMode
from pddlink.serving.backlog import WanBook, md_miss_label, report_from_status


def test_wan_book_round_trips_through_p_status_into_the_link_model() -> None:
    book = WanBook()
    book.will_ship("a")
    book.will_ship("b")
    book.started("a", 400_000)
    status = json.loads(json.dumps({"transfers": {"in_flight": 2, "wan": book.to_json()}}))
    report = report_from_status(status, at_s=10.0)
    assert report is not None and report.backlog_bytes == 400_000 and report.pending == {"b"}
    link = LinkModel(line_bytes_per_s=1e6, rtt_s=0.02)
    link.start_flow("a", 1_000_000, now=9.0)
    link.start_flow("b", 300_000, now=9.0)
    link.observe_backlog(report)
    assert link.estimate(10.1).backlog_bytes == 700_000  # a at P's figure, b at its own size
    book.ended("a")
    book.ended("b")
    assert book.to_json()["backlog_bytes"] == 0 and report_from_status({"role": "md"}, 1.0) is None


def test_a_transfer_that_lost_to_its_deadline_is_congestion() -> None:
    assert md_miss_label("deadline_exceeded: transfer missed its deadline: 0/2 chunks acknowledged") == (
        "wan_congested"
    )
    assert md_miss_label("peer_unreachable: connection refused") == "md_unreachable"


def test_prefill_book_learns_speed_and_counts_queued_work() -> None:
    book = PrefillBook(tokens_per_s=1000.0)
    book.start("a", 500)
    book.start("b", 1500)
    assert book.estimate().queue_s == pytest.approx(2.0)
    book.ready("a", 500, 0.1)  # 5000 tok/s observed
    assert 1000.0 < book.tokens_per_s < 5000.0 and book.queued_tokens == 1500
    book.finish("b")
    assert book.queue_s() == 0.0
    with pytest.raises(InvalidInput):
        PrefillBook(tokens_per_s=0.0)


def test_recompute_mode_follows_the_option() -> None:
    assert RecomputeMode.of(Option.RECOMPUTE) is RecomputeMode.AND_DECODE
    assert RecomputeMode.of(Option.RELAY_RECOMPUTE) is RecomputeMode.FOR_HANDOFF
    assert RecomputeMode.of(Option.SHIP) is RecomputeMode.NONE


def test_tpot_book_learns_from_requests_that_decoded_on_md_alone() -> None:
    from pddlink.routing.books import TpotBook

    book = TpotBook(tpot_s=0.02)
    slow = {"outcome": "finished", "tokens": {"md": 41}, "ttft_s": 0.5, "e2e_s": 8.5, "output_tokens": 41}
    book.observe(slow)  # 0.2 s per token
    assert book.tpot_s == pytest.approx(0.8 * 0.02 + 0.2 * 0.2)
    before = book.tpot_s
    book.observe({**slow, "tokens": {"md": 20, "rld": 21}})  # RLD's tokens mixed in: not MD's pace
    book.observe({**slow, "outcome": "failed"})
    assert book.tpot_s == before
