"""The WAN-overload regime in the simulator: recompute within the TPOT bound holds goodput where
shipping alone collapses and unbounded recompute breaks the TPOT SLO, rejections are counted apart,
and MD's headroom lane only uses the TPOT headroom decoding leaves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pddlink.errors import ConfigError
from pddlink.sim.md_lane import MdPrefillLane
from pddlink.sim.resources import Clock, DecodeInstance, DecodeSeq
from pddlink.sim.scenario import PaperKnobs
from pddlink.sim.wan_load import WanLoadKnobs, run_wan_load_sweep, wan_overload_scenario
from pddlink.sim.workload import DEFAULT_WORKLOAD, load_workload

SHORT = PaperKnobs(duration_s=600.0)


@pytest.fixture(scope="module")
def sweep() -> dict[str, dict[float, dict[str, object]]]:
    result = run_wan_load_sweep(load_workload(DEFAULT_WORKLOAD), SHORT, [0.5, 2.0])
    by: dict[str, dict[float, dict[str, object]]] = {}
    for row in result["rows"]:
        by.setdefault(row["deployment"], {})[row["wan_load"]] = row
    return by


def test_recompute_holds_goodput_at_twice_the_line_where_shipping_does_not(sweep: dict) -> None:
    rec, pdd = sweep["pdd_bounded"], sweep["pdd"]
    assert rec[2.0]["goodput_rps"] >= 0.8 * rec[0.5]["goodput_rps"]
    assert pdd[2.0]["goodput_rps"] < 0.8 * pdd[0.5]["goodput_rps"]
    assert rec[2.0]["decisions"]["recompute"] + rec[2.0]["decisions"]["relay_recompute"] > 0
    assert pdd[2.0]["decisions"]["recompute"] == 0
    # MD's chunked prefill, unbounded, slows every request MD decodes past the TPOT SLO
    unbounded = sweep["pdd_recompute"][2.0]
    assert unbounded["tpot_s"]["p90"] > 0.03 and unbounded["goodput_rps"] < rec[2.0]["goodput_rps"]


def test_rejections_are_counted_apart_and_rise_with_load(sweep: dict) -> None:
    cross = sweep["cross_dc_pd"]
    assert cross[2.0]["rejected_share"] > cross[0.5]["rejected_share"] + 0.1
    d = cross[2.0]["decisions"]
    assert d["rejected"] == cross[2.0]["rejected"] > 0 and d["relay"] == d["recompute"] == 0


def test_overload_scenario_offers_at_least_1_8x(sweep: dict) -> None:
    k = WanLoadKnobs(paper=replace(SHORT, duration_s=300.0))
    result = wan_overload_scenario(load_workload(DEFAULT_WORKLOAD), k)
    policies = {"cross_dc_pd", "pdd", "pdd_recompute", "pdd_bounded"}
    assert result["wan_load"] >= 1.8 and set(result["deployments"]) == policies
    with pytest.raises(ConfigError):
        WanLoadKnobs(load=0)


def test_md_lane_uses_only_the_tpot_headroom() -> None:
    from pddlink.sim.hardware import CHIP_E, AFigures, InstanceModel

    clock = Clock()
    md = DecodeInstance(clock, InstanceModel(CHIP_E, 8, AFigures()), "md0")
    lane = MdPrefillLane(clock, md, tpot_bound_s=0.03)
    idle_share = lane.share()
    for _ in range(300):
        md.admit(DecodeSeq(1000, 60000, lambda t, a: None, None, lambda t, a: None), 0.0)
    assert lane.share() < idle_share  # a busier MD leaves less room for prefill
    done: list[float] = []
    share = lane.share()
    lane.submit(4000, 0, 0.0, lambda t, a: done.append(t), None)
    slowed = md.tpot_s()
    assert slowed > md.base_step_s()  # decoding pays while the lane prefills
    clock.run(until=1000.0)
    assert done and done[0] == pytest.approx(lane.work_s(4000, 0) / share, rel=1e-6)
