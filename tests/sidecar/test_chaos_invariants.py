"""The chaos suite's invariants and schedule, on hand-made client records (pure; the suite itself
runs in tests/e2e/test_chaos.py)."""

from __future__ import annotations

import pytest

from harness.chaos.invariants import FaultRecord, evaluate, stream_gaps
from harness.chaos.load import StreamResult
from harness.chaos.schedule import Fault, FaultKind, default_schedule
from pddlink.errors import ConfigError


def result(index: int, positions: list[int], outcome: str = "finished", **kw: object) -> StreamResult:
    r = StreamResult(index, str(kw.pop("pipeline", "")), positions=positions, outcome=outcome)
    r.tokens = [p * 10 for p in positions]
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_gaps_and_duplicates_are_counted_per_position() -> None:
    assert stream_gaps(result(0, [5, 6, 7]), 5) == (0, 0)
    assert stream_gaps(result(0, [5, 7, 8]), 5) == (1, 0)
    assert stream_gaps(result(0, [6, 7]), 5) == (1, 0)  # the first token is missing
    assert stream_gaps(result(0, [5, 6, 6, 7, 5]), 5) == (0, 2)


def test_evaluate_counts_every_invariant() -> None:
    outage = FaultRecord("wan_outage_long", "wan_outage", "", 10.0, 25.0)
    rld_kill = FaultRecord("kill_restart:rld", "kill_restart", "rld", 7.0, 8.9)
    rs = [
        result(0, [3, 4], started_s=0.0, ended_s=2.0),  # fine
        result(1, [3, 4], started_s=9.0, ended_s=12.0, trace={"pipeline": "p_rld_md"}),  # RLD saved it
        result(
            2,
            [3],
            "failed",
            started_s=9.5,
            ended_s=19.5,
            reason="deadline_exceeded",
            trace={"pipeline": "p_rld_md"},
        ),  # RLD was there, it failed anyway
        result(3, [3], "failed", started_s=9.3, ended_s=11.0, trace={"pipeline": "p_md"}),  # no reason
        result(6, [3], "failed", started_s=8.5, ended_s=19.0, reason="rld_lost"),  # RLD was down
        result(4, [3, 5], started_s=20.0, ended_s=32.0),  # hung (12 s > 10 + 1) and a gap
        result(5, [], "refused", started_s=1.0, ended_s=1.1, reason="grpc_resource_exhausted: busy"),
    ]
    rs[0].tokens = [30, 41]  # differs from the reference at position 4
    reference = [[p * 10 for p in (3, 4)]] * 7
    doc = evaluate(rs, reference, [3] * 7, [rld_kill, outage], deadline_s=10.0)
    assert (doc["requests"], doc["finished"], doc["refused"], doc["hung"]) == (7, 2, 1, 1)
    assert doc["failed"] == 3 and doc["untyped_failures"] == 1
    assert doc["token_mismatches"] == 1 and doc["gaps"] == 1 and doc["duplicates"] == 0
    # in flight at 10 s: 1 (finished), 2 and 3 (failed); 6 overlapped RLD's kill: not counted
    assert (doc["outage_rld_finish_share"], doc["outage_rld_in_flight"]) == (1 / 3, 3)
    fault = doc["faults"][1]
    assert fault["in_flight"] == 4 and fault["finished"] == 1
    assert fault["failed_reasons"] == {"deadline_exceeded": 1, "(none)": 1, "rld_lost": 1}


def test_the_default_schedule_has_the_issue_faults() -> None:
    names = [f.name for f in default_schedule(10.0)]
    assert names == [
        "kill_restart:md",
        "wan_outage_short",
        "kill_restart:rld",
        "wan_outage_long",
        "one_way_cut",
        "kill_restart:p",
        "kill_engine:md",
        "wan_corrupt",
        "slow_clients",
        "burst_4x",
    ]
    by = {f.name: f for f in default_schedule(10.0)}
    assert by["wan_outage_short"].duration_s < 10.0 < by["wan_outage_long"].duration_s
    with pytest.raises(ConfigError):
        Fault(FaultKind.KILL_RESTART, 0.5, "router")
    with pytest.raises(ConfigError):
        Fault(FaultKind.WAN_OUTAGE, 1.5)
