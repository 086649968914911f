"""The paper scenario's derived settings: RLD's batch limit, the P instance size, the line-test layout."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pddlink.errors import ConfigError
from pddlink.sim.hardware import GPU_A, AFigures, InstanceModel
from pddlink.sim.scenario import (
    LINE_TEST_FIGURES,
    PAPER_FIGURES,
    PaperKnobs,
    line_test_deployments,
    paper_deployments,
    rld_batch_limit,
)
from pddlink.sim.workload import load_workload


@pytest.mark.parametrize("fig", [PAPER_FIGURES, LINE_TEST_FIGURES, AFigures(decode_seq_s=0.05)])
def test_rld_batch_limit_is_the_most_sequences_within_the_tpot(fig: AFigures) -> None:
    ctx, tpot = 65536, 0.03
    n = rld_batch_limit(fig, tpot, ctx)
    one_gpu = InstanceModel(GPU_A, 1, fig)
    assert n >= 1
    if one_gpu.step_s(1, ctx) <= tpot:  # otherwise even one sequence misses it and the floor is 1
        assert one_gpu.step_s(n, n * ctx) <= tpot + 1e-12
        assert one_gpu.step_s(n + 1, (n + 1) * ctx) > tpot
    else:
        assert n == 1


def test_paper_deployments_apply_the_rld_limit_and_the_p_instance_size() -> None:
    w = load_workload()
    intra, cross, pdd = paper_deployments(w, PaperKnobs())
    limit = rld_batch_limit(PAPER_FIGURES, w.tpot_slo_s[1], w.context_tokens)
    assert pdd.relay is not None and pdd.relay_fig is not None
    assert pdd.relay_fig.max_seqs_per_gpu == limit < PAPER_FIGURES.max_seqs_per_gpu
    for d in (intra, cross, pdd):
        assert d.prefill.gpus_per_instance == PaperKnobs().prefill_gpus_per_instance
        assert d.prefill.gpus == 40 and d.fig is PAPER_FIGURES
    assert intra.gpus == 88 and pdd.gpus == 75


def test_line_test_layout_runs_8_gpu_p_instances_at_the_line_test_speeds() -> None:
    deps = line_test_deployments(load_workload(), PaperKnobs())
    assert all(d.fig is LINE_TEST_FIGURES and d.prefill.gpus_per_instance == 8 for d in deps)


def test_p_instance_size_must_divide_the_p_gpus() -> None:
    with pytest.raises(ConfigError, match="prefill_gpus_per_instance"):
        paper_deployments(load_workload(), replace(PaperKnobs(), prefill_gpus_per_instance=3))
