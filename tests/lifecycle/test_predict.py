"""The simulator's fallback predictions come from the router's machine: a fault gives the fallback
the machine's table names, and every finished request still has all its tokens."""

from __future__ import annotations

import pytest

from pddlink.lifecycle import FailReason, Fallback, RunOutcome
from pddlink.lifecycle.predict import Faults, predict
from pddlink.routing import Pipeline
from pddlink.sim.fallbacks import FAULTS, fallback_table

CASES = [
    (Pipeline.P_MD, Faults(), (), ("md",)),
    (Pipeline.P_MD, Faults(md_reachable=False), (Fallback.MD_UNREACHABLE_P_RLD,), ("rld",)),
    (Pipeline.P_MD, Faults(md_lost_after=3), (Fallback.MD_LOST_P_RLD,), ("md", "rld")),
    (Pipeline.P_RLD_MD, Faults(), (), ("rld", "md")),
    (Pipeline.P_RLD_MD, Faults(md_reachable=False), (Fallback.MD_UNREACHABLE_RLD_FINISHES,), ("rld",)),
    (Pipeline.P_RLD_MD, Faults(rld_reachable=False), (Fallback.RLD_UNREACHABLE_MD_TAKES_OVER,), ("md",)),
    (Pipeline.P_RLD_MD, Faults(rld_lost_after=1), (Fallback.RLD_LOST_MD_TAKES_OVER,), ("rld", "md")),
    (Pipeline.P_RLD_MD, Faults(handoff_ok=False), (Fallback.HANDOFF_FAILED_RLD_FINISHES,), ("rld",)),
]


@pytest.mark.parametrize(("pipeline", "faults", "fallbacks", "sources"), CASES)
def test_prediction_is_the_machines_decision(
    pipeline: Pipeline, faults: Faults, fallbacks: tuple[Fallback, ...], sources: tuple[str, ...]
) -> None:
    p = predict(pipeline, faults, max_tokens=16)
    assert p.outcome is RunOutcome.FINISHED and p.fallbacks == fallbacks
    assert tuple(src for src, _ in p.tokens) == sources and sum(n for _, n in p.tokens) == 16


def test_unrecoverable_faults_fail_with_their_reason() -> None:
    assert (
        predict(Pipeline.P_MD, Faults(md_reachable=False, rld_usable=False)).reason
        is FailReason.MD_UNREACHABLE
    )
    assert predict(Pipeline.SINGULAR, Faults(rld_lost_after=1)).reason is FailReason.RLD_LOST


def test_the_simulators_table_covers_every_pipeline_and_fault() -> None:
    table = fallback_table()
    assert set(table) == {p.value for p in Pipeline}
    assert all(set(row) == set(FAULTS) for row in table.values())
    assert table["p_md"]["md_lost_mid_stream"]["fallbacks"] == ["md_lost_p_rld"]
