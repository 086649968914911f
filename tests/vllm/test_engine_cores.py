"""Which cores each vLLM server gets when one machine stands in for several
(``harness.vllm.pair.engine_cores``, ``VllmServerSpec.cpus``): P one half, RLD and MD the
other, halves of equal size (as many OpenMP threads everywhere), no pinning below two cores; a
pinned spec hands vLLM its own OpenMP binding of those cores."""

from __future__ import annotations

import os
from pathlib import Path

from harness.vllm.pair import engine_cores
from harness.vllm.server import VllmServerSpec


def test_p_gets_one_half_rld_and_md_the_other() -> None:
    assert engine_cores({0, 1}) == {"p": (0,), "rld": (1,), "md": (1,)}
    cores = engine_cores({4, 5, 6, 7, 8})  # odd: the spare core stays unused, halves stay equal
    assert cores["p"] == (4, 5) and cores["rld"] == cores["md"] == (6, 7)
    assert not set(cores["p"]) & set(cores["md"])


def test_one_core_is_not_pinned() -> None:
    assert engine_cores({3}) == {}


def test_a_pinned_server_binds_vllms_openmp_threads_to_its_cores() -> None:
    env = VllmServerSpec(Path("/m"), 1, cpus=(2, 3)).environ()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    unpinned = VllmServerSpec(Path("/m"), 1).environ()  # what the environment says, untouched
    assert unpinned.get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
