"""``pddlink bench extend --engine vllm --json`` runs on a real vLLM and measures what it says.

Behaviour only (timings on a shared CPU are noise): the extend's prompt came from vLLM's prefix
cache, its token equals the decode's next token (greedy, float32), and both figures are there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_bench_extend_reports_extend_against_decode_from_one_instance(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PDDLINK_CACHE": str(tmp_path), "PYTHONPATH": root}
    argv = ["bench", "extend", "--engine", "vllm", "--json", "--prompt-tokens", "64", "--tokens", "16"]
    proc = subprocess.run(
        [sys.executable, "-m", "pddlink.cli.main", *argv, "--repeats", "1"],
        env=env, capture_output=True, text=True, timeout=240, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout)
    assert figures["engine"] == "vllm" and figures["tokens"] == 16
    assert figures["extend_cached_prompt_tokens"] == 64  # the prompt came from the prefix cache
    assert figures["extend_matches_decode"] is True
    assert figures["extend_16_ms"] > 0 and figures["decode_16_ms"] > 0
    assert figures["extend_speedup"] == pytest.approx(figures["decode_16_ms"] / figures["extend_16_ms"])
