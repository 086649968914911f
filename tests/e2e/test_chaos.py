"""``pddlink chaos`` end to end, small enough for CI: the real deployment across a netlab WAN, the
default fault schedule (kill -9 and restart of MD, RLD, P and MD's engine process, WAN outages
shorter and longer than the deadline, a one-way cut, corrupted WAN packets, slow clients, a 4x
burst). Asserted: the invariants this branch guarantees (no hung request, exact tokens, no gaps or
duplicates, every failure typed, nothing held 10 s after, every fault met requests in flight, the
JSON keys the issue names, every restarted role back in the router's pool before its fault ends,
every slow client's stream over by deadline + 1 s, with a reason or cut). Not asserted: the share
of outage-stranded requests that RelayDecode finishes and the RSS bound: at this size (10 at once)
a handful of requests are stranded and restarted processes see too few requests for a baseline
of their own; ``checks/chaos`` measures both at the default size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# `fleet`: minutes of fault schedule; `make test-fleet` runs it, CI does not (checks/chaos: the default size)
pytestmark = [pytest.mark.fleet, pytest.mark.e2e, pytest.mark.netlab, pytest.mark.timeout(600)]
KEYS = {"requests", "finished", "failed", "refused", "hung", "token_mismatches", "gaps", "duplicates"}


def test_chaos_small_run_holds_its_invariants(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    argv = [sys.executable, "-m", "pddlink.cli.main", "chaos", "--requests", "120", "--concurrency", "10"]
    res = subprocess.run([*argv, "--json", str(out)], capture_output=True, text=True, timeout=580)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert KEYS | {"held_after_s10", "rss_growth_max", "outage_rld_finish_share", "faults"} <= set(doc)
    assert doc["hung"] == 0, doc["failure_reasons"]
    assert doc["token_mismatches"] == 0 and doc["gaps"] == 0 and doc["duplicates"] == 0
    assert doc["untyped_failures"] == 0
    assert doc["held_after_s10"] == {"kv_blocks": 0, "leases": 0, "waiting": 0}
    assert [f["name"] for f in doc["faults"]] == [
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
    assert doc["requests"] == 120 + 3 * 10  # the burst's requests on top
    assert all("restart failed" not in f["note"] for f in doc["faults"])
    restarts = [f for f in doc["faults"] if f["name"].startswith(("kill_restart", "kill_engine"))]
    assert all("back in the router's pool after" in f["note"] for f in restarts), restarts
    engine = next(f for f in doc["faults"] if f["name"] == "kill_engine:md")
    assert engine["note"].startswith("sidecar exited (2)"), engine  # it left the pool by itself
    assert sum(f["in_flight"] for f in doc["faults"]) >= 5  # the faults met traffic
    slow = doc["slow_clients"]
    assert slow["clients"] == 10 and slow["late"] == 0 and slow["untyped"] == 0, slow["note"]
    assert set(slow["outcomes"]) <= {"cut", "failed", "finished", "refused"}, slow["note"]
    assert out.with_suffix(".png").stat().st_size > 10_000
