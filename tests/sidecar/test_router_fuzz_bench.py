"""``pddlink bench fuzz`` runs the request-body fuzz tests with the cases asked for and reports
what they counted (a benchmark run raises CI's 100,000 per API)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_bench_fuzz_runs_the_cases_asked_for_and_reports_them() -> None:
    cases = 3000  # enough for the tests' own share checks (each side > 1% of the cases)
    out = subprocess.run(
        [sys.executable, "-m", "pddlink", "bench", "fuzz", "--cases", str(cases), "--json"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["passed"] is True and result["cases_per_api"] == cases
    for api in ("http", "grpc"):
        assert result[api]["cases"] >= cases, result
        assert result[api]["ok"] > 0 and result[api]["refused"] > 0, result
    assert result["grpc"]["undecodable"] > 0, result
