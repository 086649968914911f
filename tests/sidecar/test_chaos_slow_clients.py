"""The chaos suite's slow clients: how a stream's end is read and what counts as late (pure; the
clients themselves run in tests/e2e/test_chaos.py, the router's cut in test_slow_clients.py)."""

from __future__ import annotations

from harness.chaos.slow_clients import SlowResult, _ending, late, note, summary, writes_cut

DONE = b'data: {"id": "cmpl-1"}\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n'
ERROR = b'data: {"error": {"message": "request failed: deadline_exceeded", "type": "x"}}\n\n' + DONE


def ended(data: bytes, closed: bool) -> tuple[str, str]:
    r = SlowResult(0, "stalled")
    _ending(r, data, closed)
    return r.outcome, r.reason


def test_a_stream_ends_finished_failed_with_its_reason_or_cut() -> None:
    assert ended(DONE, closed=False) == ("finished", "")
    assert ended(ERROR, closed=False) == ("failed", "request failed: deadline_exceeded")
    assert ended(b'data: {"id": "cmpl-1"}\n\n', closed=True)[0] == "cut"
    assert ended(b'data: {"id": "cmpl-1"}\n\n', closed=False) == ("", "")  # still streaming


def test_late_is_past_deadline_plus_one_second_and_the_drain() -> None:
    ok = SlowResult(0, "stalled", started_s=1.0, ended_s=12.4, outcome="cut", reason="cut")
    slow = SlowResult(1, "trickle", started_s=1.0, ended_s=12.6, outcome="failed", reason="x")
    hung = SlowResult(2, "stalled", started_s=1.0, ended_s=2.0, outcome="hung", reason="open")
    untyped = SlowResult(3, "trickle", started_s=1.0, ended_s=2.0, outcome="failed")
    assert not late(ok, 10.0) and late(slow, 10.0) and late(hung, 10.0)
    doc = summary([ok, slow, hung, untyped], 10.0, 2.0)
    assert doc["outcomes"] == {"cut": 1, "failed": 2, "hung": 1}
    assert (doc["late"], doc["untyped"], doc["longest_s"], doc["router_writes_cut"]) == (2, 1, 11.6, 2.0)
    assert note(doc, 10.0).startswith("4 slow clients: 1 cut, 2 failed, 1 hung; 2 late, 1 untyped")


def test_the_routers_cut_count_is_read_from_its_metrics() -> None:
    text = '# HELP x\npddlink_writes_cut_total{api="grpc"} 4.0\npddlink_writes_cut_total{api="http"} 3.0\n'
    assert writes_cut(text) == 3.0
    assert writes_cut("# nothing cut yet\n") == 0.0
