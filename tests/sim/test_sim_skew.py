"""The skewed-vs-uniform microbenchmark on a short seeded run (``run_skew``'s line, see scenario.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pddlink.sim.scenario import SKEW_FLOW_CAP_GBPS, PaperKnobs, run_skew, skew_across_seeds
from pddlink.sim.workload import load_workload

KNOBS = replace(PaperKnobs(), rate_rps=80, duration_s=180, prewarm_s=60, warmup_s=80, seed=1)


@pytest.fixture(scope="module")
def out() -> dict[str, Any]:
    return run_skew(load_workload(), KNOBS)[0]


def test_uniform_median_is_several_times_the_skewed_one(out: dict[str, Any]) -> None:
    assert out["p50_ratio"] >= 3
    # The skewed tail is the large deltas at one connection's rate: 250-290 MB at 0.12 Gbit/s ~ 17-20 s.
    assert out["skewed"]["kv_transfer_s"]["p99"] >= 250e6 * 8 / (SKEW_FLOW_CAP_GBPS * 1e9) * 0.8


def test_uniform_hits_keep_the_pool_full_and_skewed_do_not(out: dict[str, Any]) -> None:
    skewed, uniform = out["skewed"], out["uniform"]
    assert uniform["pool_full_share"] >= 3 * skewed["pool_full_share"]
    assert uniform["transfers_in_flight"] >= 1.5 * skewed["transfers_in_flight"]
    # Not a load artefact: the line figures cover the measured window and both offer ~95% of it.
    for case in (skewed, uniform):
        assert 0.85 <= case["wan_utilisation"] <= 1.0 and case["pool_wait_s"] == 0.0
        assert 0 < case["pool_utilisation"] <= 1.0
    assert out["pool"] == {"size": 200, "flow_cap_gbps": SKEW_FLOW_CAP_GBPS, "discipline": "multiplexed"}


def test_across_seeds_lists_one_entry_per_seed(out: dict[str, Any]) -> None:
    across = skew_across_seeds({1: out, 2: out})
    assert across["seeds"] == [1, 2] and across["p50_ratio"] == [out["p50_ratio"]] * 2
    assert across["pool_full_share"]["uniform"] == [out["uniform"]["pool_full_share"]] * 2
