"""The demo's goodput (``harness.demo_report``): requests that met both halves of the SLO per second
of the replay, a TPOT of 0 for a one-token answer, failed and rejected requests never counted; the
wan-overload document with its three runs side by side (the keys ``checks/goodput`` reads); the
demo's ``--slo-*`` defaults stated once."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from harness.demo_load import RequestResult
from harness.demo_report import Slo, document, goodput, summarize, table, tpot_s
from pddlink.cli.demo import command as demo_command
from pddlink.errors import ConfigError

SLO = Slo(ttft_ms=500.0, tpot_ms=20.0)


def result(i: int, ttft: float | None, e2e: float, n: int, outcome: str = "finished") -> RequestResult:
    src = {"md": n} if n else {}
    return RequestResult(i, ttft, e2e, [5] * n, src, outcome, trace={"pipeline": "p_md", "option": "ship"})


RESULTS = [
    result(0, 0.2, 0.2 + 9 * 0.010, 10),  # meets both
    result(1, 0.2, 0.2 + 9 * 0.030, 10),  # too slow per token
    result(2, 0.9, 0.9 + 9 * 0.010, 10),  # first token too late
    result(3, 0.3, 0.3, 1),  # one token: no TPOT, meets
    result(4, None, 30.0, 0, "failed"),
    result(5, None, 0.01, 0, "rejected"),
]


def test_goodput_counts_requests_meeting_both_halves_per_second() -> None:
    assert tpot_s(RESULTS[0]) == pytest.approx(0.010) and tpot_s(RESULTS[3]) == 0.0
    assert [SLO.met(r) for r in RESULTS] == [True, False, False, True, False, False]
    g = goodput(RESULTS, SLO, span_s=4.0)
    assert g == {"goodput_rps": 0.5, "slo_met": 2, "replay_s": 4.0}
    looser = goodput(RESULTS, Slo(ttft_ms=1000.0, tpot_ms=40.0), span_s=4.0)
    assert looser["slo_met"] == 4


def test_an_slo_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        Slo(ttft_ms=0.0, tpot_ms=20.0)


def run(results: list[RequestResult]) -> dict[str, Any]:
    reference = [[5] * 10] * 3 + [[5]] + [[5] * 10] * 2
    return summarize(results, reference, {}, SLO, span_s=4.0)


def test_the_wan_overload_document_has_three_runs_side_by_side() -> None:
    base = run([result(i, 8.0, 9.0, 10) for i in range(3)] + [result(3, None, 30.0, 0, "failed")] * 3)
    pdd = run(RESULTS)  # the router holds the SLO
    unbounded = run([result(i, 0.1, 0.1 + 9 * 0.05, 10) for i in range(6)])  # recompute, no bound
    setting = {"slo": {"ttft_ms": 500.0, "tpot_ms": 20.0}, "scenario": "wan-overload"}
    doc = json.loads(json.dumps(document(base, pdd, setting, ("unbounded", unbounded))))  # --json
    assert set(doc["ttft_s"]) == {"baseline", "pdd", "unbounded"}
    assert doc["goodput_rps"] == {"baseline": 0.0, "pdd": 0.5, "unbounded": 0.0}
    assert doc["pdd"]["goodput_rps"] == 0.5 and doc["pdd"]["failed"] == 1
    assert doc["pdd"]["rejected"] == 1
    assert doc["unbounded"]["tokens_per_s_per_request"] == pytest.approx(20.0)
    assert doc["baseline"]["tokens_per_s_per_request"] == pytest.approx(9.0)
    assert doc["slo"] == setting["slo"] and "ttft_values" not in doc["unbounded"]
    text = table(doc)
    header = text.splitlines()[0]
    assert header.index("P->MD baseline") < header.index("PDD ") < header.index("PDD unbounded")
    assert "goodput (req/s in SLO)" in text and "TTFT <= 500 ms and TPOT <= 20 ms" in text


def test_the_default_demo_document_has_two_runs_and_goodput() -> None:
    doc = document(run(RESULTS), run(RESULTS), {"slo": {"ttft_ms": 500.0, "tpot_ms": 20.0}})
    assert "unbounded" not in doc and set(doc["goodput_rps"]) == {"baseline", "pdd"}
    assert table(doc).splitlines()[0].rstrip().endswith("PDD")


def test_demo_slo_defaults_are_the_reports_and_stated_in_help() -> None:
    out = " ".join(CliRunner().invoke(demo_command, ["--help"]).output.split())
    ttft = next(p for p in demo_command.params if p.name == "slo_ttft_ms")
    tpot = next(p for p in demo_command.params if p.name == "slo_tpot_ms")
    assert (ttft.default, tpot.default) == (Slo().ttft_ms, Slo().tpot_ms)
    assert f"[default: {Slo().ttft_ms}; x>0]" in out and f"[default: {Slo().tpot_ms}; x>0]" in out
