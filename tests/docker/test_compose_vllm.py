"""``pddlink demo --engine vllm --lab compose`` for real, small: the vLLM image built (cached after
the first time: minutes and GBs, so ``fleet``, not CI's default run), P, RLD and MD each a sidecar
container with its vLLM server container beside it, the router in its container, the WAN the lab's
relay; a P->MD baseline and a PDD run, every answer checked against P's vLLM alone, and nothing of
the lab left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.docker, pytest.mark.root, pytest.mark.vllm, pytest.mark.fleet, pytest.mark.timeout(2400),
]  # fmt: skip


def test_the_vllm_demo_runs_in_the_compose_lab_and_its_answers_match_vllm_alone(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from netlab.compose.lab import list_labs

    out = tmp_path / "demo.json"
    argv = [sys.executable, "-m", "pddlink", "demo", "--engine", "vllm", "--lab", "compose"]
    argv += ["--sessions", "2", "--turns", "3", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=2300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["lab_mode"] == "compose" and report["wan_measured"]["within_5_percent"]
    assert report["failed"] == 0 and report["token_mismatches"] == 0
    assert report["requests"] == 2 * 2 * 3  # baseline and PDD
    assert report["wan_bytes"] > 0  # the baseline's KV crossed the relay
    assert set(report["ttft_s"]) == {"baseline", "pdd"} and report["p90_ratio"] > 0
    assert not any(report["held"][side]["held_slots"] for side in report["held"])
    assert report["images"]["pddlink-engine:vllm"]["size_bytes"] > 0
    assert not [name for name in list_labs() if name.startswith("vdemo")]
