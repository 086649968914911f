"""``pddlink demo``'s flags refused at the edge, before any lab or process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "where", [["--engine", "vllm"], ["--lab", "compose"], ["--topology", "examples/topology/three-dc.toml"]]
)
def test_md_prefill_slowdown_is_refused_where_no_reference_md_would_run_it(where: list[str]) -> None:
    argv = [sys.executable, "-m", "pddlink", "demo", "--md-prefill-slowdown", "4", *where]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--md-prefill-slowdown" in out.stderr, out.stderr[-500:]
    assert "deployment up" not in out.stderr
