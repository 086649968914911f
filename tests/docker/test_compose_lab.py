"""The compose lab for real: images built (and rebuilt from cache), every role in its own container,
the WAN a netlab relay container, a request across it with mTLS, every port refusing a client
without credentials (and serving one with them), the WAN's delay and rate measured
inside the lab, an outage, and ``down`` leaving no container, network, dockerd, firewall rule or
sysctl change behind. A shorter run than ``pddlink demo --lab compose`` (CI's time budget).

The tests of this module run in file order on one lab (module fixture); the last one takes it down.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import port_probe
from netlab.compose import engine as engines
from netlab.compose import hostnet, images
from netlab.compose.lab import DEFAULT_CONFIG, ComposeLab, LabRecord, list_labs
from netlab.profile import parse_profile

pytestmark = [pytest.mark.docker, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]
PROFILE = "[link]\ndelay_ms = 10\nrate_mbit = 16\nqueue_packets = 200\n"
NAME = f"t{os.getpid() % 100000}"


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.path_ = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.path_)


def unix_request(path: str, method: str, target: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    conn = _Unix(path)
    try:
        data = json.dumps(body).encode() if body is not None else None
        # pddlink-trace: the per-choice ``pddlink`` object (opt-in since issue 27)
        headers = {"content-type": "application/json", "pddlink-trace": "1"}
        conn.request(method, target, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def pddlink(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pddlink.cli.main", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def state() -> Iterator[dict[str, Any]]:
    engine_before = engines.running_engine()
    host_before = hostnet.take_snapshot() if engine_before is None else None
    engine = engines.ensure_engine()
    try:
        first = images.build(engine, print)
        second = images.build(engine, print)
        lab = ComposeLab.up(parse_profile(PROFILE, name="t16"), name=NAME)
    except BaseException:
        if engine.own and not list_labs():
            engines.stop_engine()
        raise
    try:
        lab.deploy()
    except BaseException:
        lab.down()
        raise
    out = {"lab": lab, "builds": (first, second), "host_before": host_before, "own": engine.own}
    yield out
    if NAME in list_labs():  # a failure before the last test
        lab.down()


def test_a_second_build_reuses_every_cached_layer(state: dict[str, Any]) -> None:
    first, second = state["builds"]
    assert second.image_id == first.image_id  # nothing rebuilt: the same image
    assert not second.base_made and not second.wheels_made
    print(f"build: {first.seconds:.1f} s, rebuild: {second.seconds:.1f} s")


def test_the_image_has_no_compiler_and_roles_run_unprivileged(state: dict[str, Any]) -> None:
    lab: ComposeLab = state["lab"]
    probe = lab.engine.docker(
        ["run", "--rm", "--entrypoint", "sh", images.IMAGE, "-c", "command -v gcc || command -v cc"],
        check=False,
        timeout_s=60,
    )
    assert probe.returncode != 0, probe.stdout
    for role in ("p", "md", "router"):
        script = (
            "for s in /proc/[0-9]*/status; do"
            ' grep -q "^Name:.*pddlink" $s && grep -e ^Uid -e ^CapEff $s; done'
        )
        out = subprocess.run(
            lab.exec_argv(role, ["sh", "-c", script]), capture_output=True, text=True, timeout=30
        )
        lines = out.stdout.split("\n")
        assert any(line.split()[1:2] == ["10001"] for line in lines if line.startswith("Uid")), out.stdout
        assert all(line.split()[1] == "0" * 16 for line in lines if line.startswith("CapEff")), out.stdout


def test_a_request_crosses_the_relay_with_mtls(state: dict[str, Any]) -> None:
    lab: ComposeLab = state["lab"]
    before = lab.status()["wan"]["stats"]["a_to_b"]["delivered"]
    prompt = list(range(1, 200))
    code, reply = unix_request(
        str(lab.run_dir / "router.sock"),
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 8, "pipeline": "p_md", "return_token_ids": True},
    )
    assert code == 200, reply
    choice = reply["choices"][0]
    assert len(choice["token_ids"]) == 8
    trace = choice["pddlink"]["trace"]
    assert trace["pipeline"] == "p_md" and trace["wan_bytes"] > 0  # KV crossed the WAN
    assert lab.status()["wan"]["stats"]["a_to_b"]["delivered"] > before
    logs = lab.engine.docker(["logs", lab.container("md")]).stdout.decode()
    assert '"tls_identity": "pddlink://md/md0"' in logs


def test_every_port_refuses_a_client_without_a_key_or_certificate(
    state: dict[str, Any], tmp_path: Path
) -> None:
    """Issue 16's acceptance, from a probe container in dc-a (MD across the relay): every TCP port of
    the deployment from docker/config refuses a client with neither key nor certificate (mTLS ports:
    the handshake fails or the connection closes unanswered; HTTP ports: 401), and serves the same
    client once it has them (so the test can fail both ways). The only exceptions: /healthz and
    /readyz answer without a key (the probes of Kubernetes and the lab carry none)."""
    lab: ComposeLab = state["lab"]
    keys = {role: lab.key(role) for role in ("p", "rld", "md", "router")}
    targets = port_probe.deployment_targets(DEFAULT_CONFIG, lab.addr, keys)
    ports = {t.port for t in targets}
    assert ports == {8000, 7443, 7440, 7441, 7442, 7450, 7451, 7460, 7461, 7462}
    creds = tmp_path / "probe"
    creds.mkdir()
    for f in (lab.record.directory / "pki" / "router").iterdir():  # any certificate of the lab's CA
        shutil.copy2(f, creds / f.name)
    client = port_probe.Client("/probe/router-router0.pem", "/probe/router-router0.key", "/probe/ca.pem")
    (creds / "spec.json").write_text(port_probe.spec_json(targets, client))
    out = lab.run_in_probe(["python", "-m", "harness.port_probe", "/probe/spec.json"], files=creds)
    assert out.returncode == 0, out.stderr[-2000:]
    results = port_probe.from_json(json.loads(out.stdout))
    for r in results:
        print(r.target.name, r.target.port, "without:", {k: v.detail for k, v in r.anonymous.items()})
        print(r.target.name, r.target.port, "with:", {k: v.detail for k, v in r.credentialed.items()})
    assert len(results) == len(targets)
    assert port_probe.refusals(results) == []
    open_paths = {how for r in results for how, out in r.anonymous.items() if out.served}
    assert open_paths == {"GET /healthz", "GET /readyz"}  # the exceptions, and nothing else


def test_wan_delay_and_rate_measured_inside_the_lab_follow_the_profile(state: dict[str, Any]) -> None:
    lab: ComposeLab = state["lab"]
    m = lab.measure_wan(pings=100, iperf_s=4)
    print(f"WAN inside the compose lab: {m}")
    assert m.rtt_ms_profile <= m.rtt_ms <= 1.25 * m.rtt_ms_profile  # the delay is applied, not lost
    assert m.rate_mbit_profile is not None
    assert 0.8 * m.rate_mbit_profile <= m.rate_mbit <= 1.03 * m.rate_mbit_profile


def test_an_outage_cuts_the_wan_until_it_is_restored(state: dict[str, Any]) -> None:
    lab: ComposeLab = state["lab"]
    ping = ["ping", "-n", "-c", "3", "-i", "0.2", "-W", "1", lab.addr("md")]
    out = pddlink("lab", "compose", "outage", "--name", NAME, "--on")
    assert out.returncode == 0, out.stderr
    assert json.loads(pddlink("lab", "compose", "status", "--name", NAME, "--json").stdout)["labs"][NAME][
        "wan"
    ]["outage"]
    cut = subprocess.run(lab.exec_argv("p", ping), capture_output=True, text=True, timeout=30)
    assert cut.returncode != 0 and "100% packet loss" in cut.stdout
    assert pddlink("lab", "compose", "outage", "--name", NAME, "--off").returncode == 0
    back = subprocess.run(lab.exec_argv("p", ping), capture_output=True, text=True, timeout=30)
    assert back.returncode == 0, back.stdout


def test_down_leaves_no_container_network_dockerd_rule_or_sysctl(state: dict[str, Any]) -> None:
    lab: ComposeLab = state["lab"]
    record: LabRecord = lab.record
    out = pddlink("lab", "compose", "down", "--name", NAME, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["removed"][NAME]["containers"] == 5 and report["removed"][NAME]["networks"] == 2
    assert report["left"] == []
    assert NAME not in list_labs() and not record.directory.exists()
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert record.bridge("dc-a") not in links and record.bridge("dc-b") not in links
    engine = engines.running_engine()
    if engine is not None:  # the machine's own engine, or one another lab still uses
        label = f"label=com.docker.compose.project={record.project}"
        assert engine.docker(["ps", "-aq", "--filter", label]).stdout.strip() == b""
        assert engine.docker(["network", "ls", "-q", "--filter", label]).stdout.strip() == b""
    if state["host_before"] is not None and not list_labs():
        assert engines.own_pid() == 0 and engines.leftovers() == []
        assert hostnet.differences(state["host_before"]) == []
        assert not Path(engines.own_socket()).exists()
