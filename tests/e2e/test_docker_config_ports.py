"""The compose lab's role configs (docker/config/*.toml) as four processes on this machine, without a
container engine: each bound to 0.0.0.0 as in the lab, with only what names container paths or
hosts replaced by flags (the PKI and key files' paths, peer addresses, and free ports in place of
the fixed ones). Every port they expose refuses a client with neither key nor certificate and
serves one with them (``harness.port_probe``, as the compose lab's probe container does); /healthz
and /readyz are the only paths that answer without a key. ``tests/docker/test_compose_lab.py``
runs the same probe inside the lab."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import port_probe
from harness.cluster import free_port
from netlab.compose.lab import DEFAULT_CONFIG, IDENTITY, KEY_FILE
from pddlink.serving.client_guard import write_key_file
from pddlink.transport import PeerIdentity
from pddlink.transport.pki import create_ca, issue_node

pytestmark = [pytest.mark.e2e, pytest.mark.process, pytest.mark.timeout(300)]
PORTS = (7440, 7441, 7442, 7443, 7450, 7451, 7460, 7461, 7462, 8000)


def _ready(proc: subprocess.Popen[str], log: Path, deadline: float) -> None:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY"):
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no READY: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, dict[int, int], dict[str, str]]]:
    """(run directory, config port -> bound port, role -> bearer key)."""
    run = tmp_path_factory.mktemp("ports")
    create_ca(run / "ca")
    keys = {}
    for role in ("md", "rld", "p", "router"):
        issue_node(run / "ca", run / "pki" / role, PeerIdentity(role, IDENTITY[role]))
        (run / "keys" / role).mkdir(parents=True)
        keys[role] = write_key_file(run / "keys" / role / KEY_FILE[role])
    port = {p: free_port() for p in PORTS}
    at = {name: f"127.0.0.1:{port[p]}" for name, p in (("md", 7440), ("rld", 7441), ("p", 7442))}
    kv = {"md": f"127.0.0.1:{port[7450]}", "rld": f"127.0.0.1:{port[7451]}"}
    argv: dict[str, list[str]] = {}
    for role, grpc, kvp, admin in (("md", 7440, 7450, 7460), ("rld", 7441, 7451, 7461), ("p", 7442, 0, 7462)):
        a = [
            "sidecar",
            "--config",
            str(DEFAULT_CONFIG / f"{role}.toml"),
            "--tls-dir",
            str(run / "pki" / role),
        ]
        a += ["--admin-keys-file", str(run / "keys" / role / KEY_FILE[role])]
        a += ["--admin-unix", str(run / f"{role}.admin.sock"), "--num-blocks", "256"]
        a += ["--grpc-port", str(port[grpc]), "--admin-port", str(port[admin])]
        a += ["--kv-port", str(port[kvp])] if kvp else []
        argv[role] = a
    argv["rld"] += ["--md-grpc", at["md"]]
    argv["p"] += ["--md-grpc", at["md"], "--md-kv", kv["md"], "--rld-grpc", at["rld"], "--rld-kv", kv["rld"]]
    argv["router"] = ["router", "--config", str(DEFAULT_CONFIG / "router.toml"), "--p", at["p"]]
    argv["router"] += ["--rld", at["rld"], "--md", at["md"], "--unix", str(run / "router.sock")]
    argv["router"] += ["--grpc-port", str(port[7443]), "--http-port", str(port[8000])]
    argv["router"] += ["--tls-dir", str(run / "pki" / "router")]
    argv["router"] += ["--api-keys-file", str(run / "keys" / "router" / "api-keys")]
    procs: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 240
        for role in ("md", "rld", "p", "router"):  # P dials MD and RLD as it starts: they come first
            log = run / f"{role}.log"
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pddlink.cli.main", *argv[role]],
                    stdout=subprocess.PIPE,
                    stderr=log.open("w"),
                    text=True,
                )
            )
            _ready(procs[-1], log, deadline)
        yield run, port, keys
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_every_port_of_the_docker_configs_refuses_an_anonymous_client(
    deployment: tuple[Path, dict[int, int], dict[str, str]],
) -> None:
    run, port, keys = deployment
    targets = port_probe.deployment_targets(DEFAULT_CONFIG, lambda role: "127.0.0.1", keys, port.get)
    assert sorted(port[p] for p in PORTS) == sorted(t.port for t in targets)  # every port, no other
    pki = run / "pki" / "router"
    client = port_probe.Client(
        str(pki / "router-router0.pem"), str(pki / "router-router0.key"), str(pki / "ca.pem")
    )
    results = [port_probe.probe(t, client) for t in targets]
    for r in results:
        print(r.target.name, r.target.port, "without:", {k: v.detail for k, v in r.anonymous.items()})
        print(r.target.name, r.target.port, "with:", {k: v.detail for k, v in r.credentialed.items()})
    assert port_probe.refusals(results) == []
    served = {how for r in results for how, out in r.anonymous.items() if out.served}
    assert served == {"GET /healthz", "GET /readyz"}  # the probes' paths, and nothing else


def test_the_probe_sees_a_port_that_serves_anyone(tmp_path: Path) -> None:
    """The checks can fail: a plaintext, keyless HTTP server, probed as an HTTP port and as an mTLS one."""
    script = (
        "import asyncio\nfrom pddlink.serving.http import serve_http, json_response\n"
        "async def h(req):\n    return json_response(200, {'ok': True})\n"
        "async def main():\n    s = await serve_http(h, host='127.0.0.1', port=0)\n"
        "    print(s[0].sockets[0].getsockname()[1], flush=True)\n    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        open_port = int(proc.stdout.readline())
        create_ca(tmp_path / "ca")
        tls = issue_node(tmp_path / "ca", tmp_path / "node", PeerIdentity("router", "router0"))
        client = port_probe.Client(str(tls.cert_file), str(tls.key_file), str(tls.ca_file))
        open_http = port_probe.Target("open", "127.0.0.1", open_port, "http", ("GET /status",), (), "k" * 20)
        as_tls = port_probe.Target("open as tls", "127.0.0.1", open_port, "tls")
        wrong = port_probe.refusals([port_probe.probe(open_http, client), port_probe.probe(as_tls, client)])
        assert any(
            "open 127.0.0.1" in w and "without credentials (GET /status: HTTP 200)" in w for w in wrong
        )
        assert any("open as tls" in w and "plaintext" in w for w in wrong)
        assert any("open as tls" in w and "refused a client with credentials" in w for w in wrong)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_completion_goes_through_with_the_key(
    deployment: tuple[Path, dict[int, int], dict[str, str]],
) -> None:
    _, port, keys = deployment
    body = json.dumps({"prompt": list(range(1, 40)), "max_tokens": 4, "return_token_ids": True})
    conn = http.client.HTTPConnection("127.0.0.1", port[8000], timeout=60)
    conn.request("POST", "/v1/completions", body, {"authorization": f"Bearer {keys['router']}"})
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, reply
    assert len(reply["choices"][0]["token_ids"]) == 4
