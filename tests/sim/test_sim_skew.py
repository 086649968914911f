"""The skewed-vs-uniform microbenchmark on a short seeded run: what the model does and does not show."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pddlink.sim.scenario import PaperKnobs, run_skew
from pddlink.sim.workload import load_workload

KNOBS = replace(PaperKnobs(), rate_rps=80, duration_s=60, prewarm_s=60, warmup_s=80, seed=3)


@pytest.fixture(scope="module")
def runs() -> dict[bool, dict[str, Any]]:
    w = load_workload()
    return {fifo: run_skew(w, KNOBS, fifo_pool=fifo)[0] for fifo in (False, True)}


def test_uniform_median_is_several_times_the_skewed_one_and_saturates_the_pool(
    runs: dict[bool, dict[str, Any]],
) -> None:
    out = runs[False]
    assert out["p50_ratio"] >= 2.5
    uniform = out["uniform"]
    assert uniform["pool_full_share"] >= 0.85 and uniform["pool_utilisation"] >= 0.95
    # The line figures cover the measured window only, so they reflect the ~95% offered load.
    for case in ("skewed", "uniform"):
        assert 0.85 <= out[case]["wan_utilisation"] <= 1.0
        assert out[case]["pool_wait_s"] == 0.0  # multiplexed: nobody waits for a connection
    assert out["pool"] == {"size": 16, "flow_cap_gbps": 1.2, "discipline": "multiplexed"}


def test_a_fifo_pool_makes_small_transfers_queue_behind_large_ones(runs: dict[bool, dict[str, Any]]) -> None:
    multiplexed, fifo = runs[False], runs[True]
    assert fifo["skewed"]["pool_wait_s"] > 0.5
    assert fifo["skewed"]["kv_transfer_s"]["p50"] > 5 * multiplexed["skewed"]["kv_transfer_s"]["p50"]
    assert fifo["p50_ratio"] < 1  # skewed is worse than uniform once transfers hold connections
