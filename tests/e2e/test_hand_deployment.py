"""docs/deploy.md, followed literally: the loopback section's commands run in order in a scratch
directory (with the repository's examples/), the long-running ones (blocks starting `# terminal N`)
as background processes that must print READY, and the section's Python client must end with a
streaming completion that has text, usage and finish_reason "length".
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"


def section_blocks(title: str) -> list[tuple[str, str]]:
    text = DOC.read_text()
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return [(lang, body) for lang, body in re.findall(r"```(sh|python)\n(.*?)```", section, re.S)]


def loopback_blocks() -> list[tuple[str, str]]:
    return section_blocks("Loopback: four processes on 127.0.0.1")


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def run_blocks(blocks: list[tuple[str, str]], cwd: Path, procs: list[subprocess.Popen[str]]) -> str:
    """Run the documented blocks in order; returns the Python block's output."""
    env, printed = _env(), ""
    for lang, body in blocks:
        if lang == "python":
            out = subprocess.run(
                [sys.executable, "-c", body], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
            )
            assert out.returncode == 0, out.stdout + out.stderr
            printed += out.stdout
            continue
        if body.startswith("# terminal"):
            log_path = cwd / f"{len(procs)}.log"
            log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
            p = subprocess.Popen(
                ["bash", "-ec", body], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                start_new_session=True,
            )  # fmt: skip
            procs.append(p)
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("READY"), (body, line, log_path.read_text()[-2000:])
            continue
        out = subprocess.run(
            ["bash", "-ec", body], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stdout + out.stderr
    return printed


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in reversed(procs):
        os.killpg(os.getpgid(p.pid), signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(os.getpgid(p.pid), signal.SIGKILL)
            p.wait()


def _refuses_anonymous(port: int) -> bool:
    """A TLS client without a certificate (and a plaintext one) gets nothing from ``port``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    for wrap in (True, False):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                s = ctx.wrap_socket(raw) if wrap else raw
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0" * 64)
                if s.recv(4096) and not wrap:
                    return False  # plaintext got an answer
                if wrap and s.recv(4096):
                    return False
        except (ssl.SSLError, ConnectionError, TimeoutError, OSError):
            continue
    return True


def test_the_documented_steps_are_there() -> None:
    blocks = loopback_blocks()
    terminals = [b for lang, b in blocks if lang == "sh" and b.startswith("# terminal")]
    assert len(terminals) == 4 and sum(lang == "python" for lang, _ in blocks) == 1


@pytest.mark.timeout(400)
def test_hand_deployment_from_the_docs(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    procs: list[subprocess.Popen[str]] = []
    try:
        printed = run_blocks(loopback_blocks(), tmp_path, procs)
        assert "['tiny']" in printed and re.search(r"' length \d+ 12$", printed, re.M), printed
        assert (tmp_path / "run" / "api-keys").stat().st_mode & 0o077 == 0
        for port in (27440, 27450, 27441, 27451, 27442, 27443):
            assert _refuses_anonymous(port), f"port {port} served a client without a certificate"
        conn = http.client.HTTPConnection("127.0.0.1", 28000, timeout=10)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 401
        conn.close()
        _stop_string_cancels(f"Bearer {(tmp_path / 'run' / 'api-keys').read_text().strip()}")
    finally:
        stop_all(procs)


def _stop_string_cancels(auth: str) -> None:
    """A stop string ends the choice and the router's request with it: nothing stays in flight."""

    def call(method: str, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
        conn = http.client.HTTPConnection("127.0.0.1", 28000, timeout=60)
        conn.request(method, path, json.dumps(body) if body else None, {"authorization": auth})
        out: dict[str, object] = json.loads(conn.getresponse().read())
        conn.close()
        return out

    for prompt in ("prefill decode", "relay main wan", "token stream"):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "stop": [" "], "temperature": 0}
        answer = call("POST", "/v1/completions", body)
        choice = answer["choices"][0]  # type: ignore[index]
        if choice["stop_reason"] == " ":
            assert choice["finish_reason"] == "stop" and " " not in choice["text"]
            assert answer["usage"]["completion_tokens"] < 400  # type: ignore[index]
            time.sleep(0.5)
            assert call("GET", "/status")["in_flight"] == {}
            return
    pytest.fail("no stop string met in three prompts")


@pytest.mark.fleet  # the same steps as above across namespaces: `make test-fleet`
@pytest.mark.root
@pytest.mark.netlab
@pytest.mark.timeout(400)
def test_netns_hand_deployment_from_the_docs(tmp_path: Path) -> None:
    """The network-namespace section, literally: step 1 of the loopback section, then its blocks."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    procs: list[subprocess.Popen[str]] = []
    try:
        run_blocks(loopback_blocks()[:1], tmp_path, procs)
        printed = run_blocks(section_blocks("Network namespaces (root)"), tmp_path, procs)
        assert re.search(r"' length 12$", printed, re.M), printed
    finally:
        stop_all(procs)
        subprocess.run(["pddlink", "lab", "net", "down", "--name", "deploy-ns"], env=_env(), timeout=60)
