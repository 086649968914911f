"""docs/deploy.md's vLLM section, followed literally: three ``pddlink sidecar`` processes whose files
say ``engine = "vllm"``, three vLLM servers started with vLLM's own module entry point and the
arguments ``--print-vllm-args`` prints, the router, and a streaming completion through the official
``openai`` client. Then what the deployment must refuse: a KV client without an issued certificate
on the vLLM sidecars' KV ports, a request without the API key.

No harness module starts anything here: the commands are the documented ones.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_hand_deployment import ROOT, _env, _refuses_anonymous, section_blocks, stop_all

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
TITLE = "vLLM: P, RLD and MD as vLLM servers, each beside `pddlink sidecar`"


def vllm_blocks() -> list[tuple[str, str]]:
    return section_blocks(TITLE)


def _wait_health(port: int, proc: subprocess.Popen[str], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vLLM on {port} exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"vLLM on {port} not healthy in {timeout_s} s: {log.read_text()[-3000:]}")


def run_vllm_blocks(cwd: Path, procs: list[subprocess.Popen[str]]) -> str:
    """The section's blocks in order: a `# terminal` block with vLLM's entry point runs until its
    /health answers; any other `# terminal` block until it prints READY."""
    env, printed = _env(), ""
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the documented command sets it
    for lang, body in vllm_blocks():
        if lang == "python":
            out = subprocess.run(
                ["python", "-c", body], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
            )
            assert out.returncode == 0, out.stdout + out.stderr
            printed += out.stdout
            continue
        if not body.startswith("# terminal"):
            out = subprocess.run(
                ["bash", "-ec", body], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
            )
            assert out.returncode == 0, out.stdout + out.stderr
            continue
        log_path = cwd / f"{len(procs)}.log"
        log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
        vllm = "vllm.entrypoints.openai.api_server" in body
        out_to = log if vllm else subprocess.PIPE
        p = subprocess.Popen(
            ["bash", "-ec", body],
            cwd=cwd,
            env=env,
            stdout=out_to,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        procs.append(p)
        if vllm:
            port = int(re.search(r"--port (\d+)", body).group(1))  # type: ignore[union-attr]
            _wait_health(port, p, log_path, 420)
            continue
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("READY"), (body, line, log_path.read_text()[-2000:])
        ready = json.loads(line.removeprefix("READY "))
        if "engine" in ready:
            assert ready["engine"] == "vllm" and Path(cwd, ready["control_socket"]).is_socket()
    return printed


def test_the_vllm_steps_are_there_and_use_no_harness() -> None:
    blocks = vllm_blocks()
    terminals = [b for lang, b in blocks if lang == "sh" and b.startswith("# terminal")]
    assert len(terminals) == 7 and sum(lang == "python" for lang, _ in blocks) == 1
    sidecars = [b for b in terminals if "pddlink sidecar --config" in b and "--print-vllm-args" not in b]
    assert len(sidecars) == 3
    for body in terminals:
        assert "harness" not in body and "pair" not in body
        if "vllm.entrypoints" in body:  # vLLM's own entry point, with the sidecar's printed arguments
            assert re.search(
                r"\$\(pddlink sidecar --config examples/deploy/vllm/\w+\.toml --print-vllm-args\)", body
            )
    for role in ("p", "rld", "md"):
        text = (ROOT / "examples" / "deploy" / "vllm" / f"{role}.toml").read_text()
        assert re.search(r'^engine = "vllm"$', text, re.M) and re.search(rf'^role = "{role}"$', text, re.M)


def test_the_printed_arguments_point_vllm_at_its_sidecar() -> None:
    out = subprocess.run(
        ["pddlink", "sidecar", "--config", "examples/deploy/vllm/md.toml", "--print-vllm-args"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    words = out.stdout.split()
    cfg = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "PddlinkConnector" and cfg["kv_role"] == "kv_consumer"
    assert cfg["kv_connector_extra_config"]["control_socket"] == str(ROOT / "run" / "md0.sock")
    events = json.loads(words[words.index("--kv-events-config") + 1])
    assert events["endpoint"] == "ipc://run/md-events.ipc" and words[words.index("--block-size") + 1] == "32"


def _status(cwd: Path, role: str) -> dict[str, Any]:
    status = subprocess.run(
        ["curl", "-s", "--unix-socket", f"run/{role}.admin.sock", "http://x/status"],
        cwd=cwd, capture_output=True, text=True, timeout=10, check=True,
    )  # fmt: skip
    out: dict[str, Any] = json.loads(status.stdout)
    return out


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.fleet
def test_vllm_hand_deployment_from_the_docs(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    busy = [p for p in (27450, 27451, 27443, 28000, 8100, 8101, 8102) if not _closed(p)]
    assert not busy, f"ports in use: {busy}"
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    procs: list[subprocess.Popen[str]] = []
    try:
        printed = run_vllm_blocks(tmp_path, procs)
        assert re.search(r"' length \d+ 12$", printed, re.M), printed
        for port in (27450, 27451, 27443):  # the vLLM sidecars' KV ports and the router's gRPC port
            assert _refuses_anonymous(port), f"port {port} served a client without a certificate"
        conn = http.client.HTTPConnection("127.0.0.1", 28000, timeout=10)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 401
        conn.close()
        # the request ended on MD or (12 tokens: RLD can finish first) on RLD: that one's DRC
        # followed its vLLM's KV-cache events (they travel on their own socket: let them land)
        deadline = time.monotonic() + 10
        while True:
            seen = {role: _status(tmp_path, role) for role in ("md", "rld")}
            batches = sum(s["kv_events"]["batches"] for s in seen.values())
            if batches or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert all(s["engine_kind"] == "vllm" and s["engine"]["state"] != "lost" for s in seen.values()), seen
        assert batches > 0, json.dumps(seen)[:3000]
    finally:
        stop_all(procs)
    assert not (tmp_path / "run" / "md0.sock").exists()  # SIGTERM: the sidecar removed its socket
