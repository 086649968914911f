"""The namespaced lab with real traffic: accuracy, lossy links, outages, bad input, no leftovers.

Needs root (namespaces, TUN) and iperf3; figures are measured with an echo probe (UDP) and iperf3
(TCP) between the datacenters. Tolerances follow the issue: the RTT the profile adds on top of the
hosts' own path (measured first with no delay) within max(5%, 0.3 ms) (the median is asserted
strictly, the mean more loosely because CI shares two cores), loss within three
standard errors, TCP rate within a few percent of the configured IP rate.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from netlab.lab import Lab
from netlab.profile import parse_profile
from netlab.state import existing_netns, netns_names, read_state, relay_pids, run_root
from pddlink.errors import ConfigError, InvalidInput

pytestmark = [pytest.mark.root, pytest.mark.netlab, pytest.mark.timeout(120)]
needs_iperf3 = pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed")

PROBE = textwrap.dedent(
    """
    import json, socket, statistics, struct, sys, time
    if sys.argv[1] == "serve":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", int(sys.argv[2])))
        s.settimeout(30)
        while True:
            data, addr = s.recvfrom(2048); s.sendto(data, addr)
    host, port, n, gap = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(gap)
    rtts, got, t0 = [], set(), time.monotonic()
    for i in range(n):
        s.sendto(struct.pack("!Id", i, time.monotonic()) + b"x" * 64, (host, port))
        while time.monotonic() < t0 + (i + 1) * gap:
            try:
                data = s.recv(2048)
            except TimeoutError:
                break
            k, sent = struct.unpack("!Id", data[:12])
            got.add(k); rtts.append((time.monotonic() - sent) * 1e3)
    s.settimeout(1.0)
    try:
        while True:
            data = s.recv(2048); k, sent = struct.unpack("!Id", data[:12]); got.add(k)
            rtts.append((time.monotonic() - sent) * 1e3)
    except TimeoutError:
        pass
    rtts = rtts or [-1.0]
    print(json.dumps({"sent": n, "received": len(got), "lost": sorted(set(range(n)) - got),
                      "rtt_ms_mean": statistics.mean(rtts), "rtt_ms_p50": statistics.median(rtts)}))
    """
)


@pytest.fixture(scope="module")
def probe_script(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("netlab") / "probe.py"
    path.write_text(PROBE)
    return str(path)


def profile(delay_ms: float, loss: float = 0.0, rate_mbit: float = 0.0, extra: str = "") -> str:
    link = f"[link]\ndelay_ms = {delay_ms}\nloss = {loss}\nrate_mbit = {rate_mbit}\nqueue_packets = 1000\n"
    return link + extra


def rt(argv: list[str]) -> list[str]:
    """Run a probe endpoint at real-time priority: CI shares two cores, and an endpoint that wakes a
    millisecond late would be counted as link delay (the relay's own lateness is asserted apart)."""
    return ["chrt", "-f", "5", *argv] if shutil.which("chrt") else argv


def probe(lab: Lab, script: str, n: int, gap_s: float, port: int = 9977) -> dict[str, object]:
    server = lab.popen("dc-b", rt([sys.executable, script, "serve", str(port)]))
    try:
        time.sleep(0.2)
        out = lab.run(
            "dc-a",
            rt([sys.executable, script, "probe", lab.addr("dc-b"), str(port), str(n), str(gap_s)]),
            timeout_s=n * gap_s + 20,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        result: dict[str, object] = json.loads(out.stdout)
        return result
    finally:
        server.kill()
        server.wait(5)


def iperf3_mbit(lab: Lab, seconds: float, cc: str = "bbr", port: int = 5201) -> float:
    """iperf3's goodput from dc-a to dc-b. iperf3 itself now and then hangs after a test on a lossy
    line (seen once in CI: no output for 20 s while the lab kept forwarding), so one hang is retried
    on a fresh server; a second one fails the test."""
    try:
        return _iperf3_once(lab, seconds, cc, port)
    except subprocess.TimeoutExpired as exc:
        print(f"iperf3 hung ({exc}); retrying once")
        return _iperf3_once(lab, seconds, cc, port + 1)


def _iperf3_once(lab: Lab, seconds: float, cc: str, port: int) -> float:
    server = lab.popen("dc-b", ["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        argv = ["iperf3", "-c", lab.addr("dc-b"), "-p", str(port), "-t", str(seconds), "-C", cc, "-J"]
        out = lab.run("dc-a", argv, timeout_s=seconds + 20, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-400:]
        return float(json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"]) / 1e6
    finally:
        server.kill()
        server.wait(5)


def leftovers(name: str) -> list[str]:
    found = [f"netns {ns}" for ns in set(netns_names(name).values()) & existing_netns()]
    found += [f"relay pid {p}" for p in relay_pids(name)]
    if (run_root() / name).exists():
        found.append(f"state dir {run_root() / name}")
    return found


def _rtt_off_by(lab: Lab, probe_script: str) -> tuple[float, float, dict[str, object]]:
    """(p50 error, mean error) in ms of the profile's 10 ms RTT, over the hosts' own path measured
    just before without delay, and the probe's figures. The hosts' path is 0.25-0.4 ms in this VM,
    more when its idle vCPUs are slow to wake (0.9-1.9 ms at times, on a quiet machine)."""
    lab.set_profile(parse_profile(profile(0.0)))
    base = float(probe(lab, probe_script, 500, 0.001)["rtt_ms_p50"])  # type: ignore[arg-type]
    assert 0 < base < 3.0  # only catches a relay gone wrong: the checks are against this base
    lab.set_profile(parse_profile(profile(5.0, loss=0.02)))
    p = probe(lab, probe_script, 1500, 0.001)
    p50 = abs(float(p["rtt_ms_p50"]) - base - 10.0)  # type: ignore[arg-type]
    return p50, abs(float(p["rtt_ms_mean"]) - base - 10.0), p  # type: ignore[arg-type]


def test_rtt_loss_and_rate_match_the_profile(probe_script: str) -> None:
    with Lab.up(parse_profile(profile(0.0)), name="t-accuracy") as lab:
        assert lab.addr("dc-a").startswith("198.18.") and lab.addr("dc-b").startswith("198.18.")
        # the VM's wake-up noise moves one measurement by 1-2 ms at times: three tries, and the
        # emulator must hit the profile within 0.5 ms in one of them (a wrong delay misses in all)
        for _ in range(3):
            p50_err, mean_err, p = _rtt_off_by(lab, probe_script)
            if p50_err <= 0.5 and mean_err <= 1.5:
                break
        assert p50_err <= 0.5 and mean_err <= 1.5, (p50_err, mean_err, p)
        assert lab.status()["release_lag_ms_mean"] < 0.3  # the relay itself releases packets on time
        expected = 1 - (1 - 0.02) ** 2
        loss = 1 - int(p["received"]) / 1500  # type: ignore[call-overload]
        assert abs(loss - expected) <= 3 * math.sqrt(expected * (1 - expected) / 1500)
        if shutil.which("iperf3"):
            lab.set_profile(parse_profile(profile(5.0, rate_mbit=100.0)))
            rates = [iperf3_mbit(lab, 3)]
            if not 0.90 * 100 <= rates[0] <= 1.02 * 100:  # the same noise, once more
                rates.append(iperf3_mbit(lab, 3))
            assert 0.90 * 100 <= rates[-1] <= 1.02 * 100, rates


def test_lossy_longhaul_profile_loss_and_tcp(probe_script: str) -> None:
    with Lab.up("lossy-longhaul", name="t-lossy") as lab:
        spec = parse_profile(Path("netlab/profiles/lossy-longhaul.toml").read_text()).a_to_b
        assert spec.gilbert_elliott is not None
        one_way = 1 - (1 - spec.loss) * (1 - spec.gilbert_elliott.mean_loss) * (1 - spec.corrupt)
        p = probe(lab, probe_script, 2000, 0.001)
        loss = 1 - int(p["received"]) / 2000  # type: ignore[call-overload]
        expected = 1 - (1 - one_way) ** 2
        assert 0.4 * expected <= loss <= 2.0 * expected  # bursty: wide, but catches a dead model
        assert abs(float(p["rtt_ms_p50"]) - 50.0) <= 2.5  # type: ignore[arg-type]
        stats = lab.status()["stats"]["a_to_b"]
        assert stats["dropped_loss"] > 0
        assert iperf3_mbit(lab, 3) > 50.0  # BBR keeps going through ~1% bursty loss


def probe_with(lab: Lab, script: str, during: object, n: int = 1000, gap_s: float = 0.002) -> list[int]:
    """Probe for n * gap_s seconds; ``during(lab)`` runs 0.8 s in; returns the lost probe numbers."""
    server = lab.popen("dc-b", rt([sys.executable, script, "serve", "9977"]))
    try:
        time.sleep(0.2)
        argv = [sys.executable, script, "probe", lab.addr("dc-b"), "9977", str(n), str(gap_s)]
        client = lab.popen("dc-a", rt(argv), stdout=subprocess.PIPE, text=True)
        time.sleep(0.8)
        during(lab)  # type: ignore[operator]
        out, _ = client.communicate(timeout=30)
    finally:
        server.kill()
        server.wait(5)
    lost: list[int] = json.loads(out)["lost"]
    return lost


def assert_one_gap(lost: list[int], seconds: float, gap_s: float = 0.002) -> None:
    expected = seconds / gap_s
    assert 0.85 * expected <= len(lost) <= 1.15 * expected + 5, len(lost)
    assert max(lost) - min(lost) <= expected + 10  # one contiguous gap


def test_scheduled_outage_cuts_the_link_once(probe_script: str) -> None:
    extra = "[[outage]]\nstart_s = 1.5\nduration_s = 0.5\n"
    with Lab.up(parse_profile(profile(1.0, extra=extra)), name="t-sched") as lab:
        lost = probe_with(lab, probe_script, lambda _lab: None)
        assert_one_gap(lost, 0.5)
        assert lab.status()["stats"]["a_to_b"]["dropped_outage"] > 0


def test_manual_outage_in_the_middle_and_on_off(probe_script: str) -> None:
    with Lab.up(parse_profile(profile(1.0)), name="t-outage") as lab:
        states: list[bool] = []

        def cut(lab: Lab) -> None:
            lab.outage(0.5)  # a half-second cut in the middle of a 2-second probe
            states.append(lab.status()["outage"])

        assert_one_gap(probe_with(lab, probe_script, cut), 0.5)
        assert states == [True] and lab.status()["outage"] is False
        lab.set_outage(True)
        assert lab.status()["outage"] is True and lab.status()["outage_left_s"] is None
        lab.set_outage(False)
        assert lab.status()["outage"] is False
        lab.set_outage(True, "b_to_a")  # replies cut, requests pass
        assert lab.status()["cut"] == {"a_to_b": False, "b_to_a": True}
        before = lab.status()["stats"]
        p = probe(lab, probe_script, 50, 0.002)
        after = lab.status()["stats"]
        assert p["received"] == 0
        assert after["a_to_b"]["dropped_outage"] == before["a_to_b"]["dropped_outage"]
        assert after["b_to_a"]["dropped_outage"] >= before["b_to_a"]["dropped_outage"] + 50
        lab.set_outage(False, "b_to_a")
        with pytest.raises(InvalidInput):
            lab.outage(-1)
        with pytest.raises(InvalidInput):
            lab.outage(1, "up")


def test_bad_profile_creates_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[link]\ndelay_ms = 10\nloss = 7\n")
    before = existing_netns()
    with pytest.raises(ConfigError, match=r"link\.loss"):
        Lab.up(str(bad), name="t-bad")
    with pytest.raises(InvalidInput):
        Lab.up("clean", name="Bad Name!")
    assert existing_netns() == before
    assert not leftovers("t-bad")


def root_links() -> set[str]:
    return {d.name for d in Path("/sys/class/net").iterdir()}


def test_down_leaves_nothing_and_ends_processes_inside() -> None:
    lab = Lab.up("clean", name="t-leak")
    state = read_state("t-leak")
    assert state is not None
    sleeper = lab.popen("dc-a", ["sleep", "60"])
    server = lab.popen("dc-b", [sys.executable, "-m", "http.server", "8089", "--bind", lab.addr("dc-b")])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the host reaches a datacenter directly (control, metrics)
        try:
            socket.create_connection((lab.addr("dc-b"), 8089), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        pytest.fail("the host cannot reach dc-b")
    links = root_links()
    assert set(state.host_links) <= links and not set(state.tun.values()) & links  # TUN devices live inside
    lab.down()
    assert sleeper.wait(5) is not None and server.wait(5) is not None
    assert not leftovers("t-leak") and not set(state.host_links) & root_links()
    lab.down()  # idempotent
    with pytest.raises(Exception, match="no lab"):
        Lab.attach("t-leak")


def _reached(stage: str, name: str) -> bool:
    if stage == "recorded":
        return (run_root() / name / "state.json").exists()
    if stage == "netns":
        return netns_names(name)["dc-b"] in existing_netns()
    return bool(relay_pids(name))


@pytest.mark.parametrize(
    ("sig", "stage"),
    [
        (signal.SIGINT, "recorded"),
        (signal.SIGINT, "netns"),
        (signal.SIGINT, "relay"),
        (signal.SIGTERM, "netns"),
    ],
)
def test_interrupted_up_leaves_nothing(sig: signal.Signals, stage: str) -> None:
    name = "t-intr"
    proc = subprocess.Popen(
        ["pddlink", "lab", "net", "up", "--name", name, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 20
    while not _reached(stage, name) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(sig)  # half-way: the stage is there, `up` has not returned
    out, err = proc.communicate(timeout=30)
    if proc.returncode == 0:  # it finished before the signal landed: then `down` must clean it
        subprocess.run(["pddlink", "lab", "net", "down", "--name", name], check=True, timeout=30)
    assert not leftovers(name), err
    assert proc.returncode != 0 or out  # either interrupted, or it had finished and printed the lab


def test_killed_up_is_cleaned_by_down_and_a_crashed_owner_by_the_relay() -> None:
    proc = subprocess.Popen(["pddlink", "lab", "net", "up", "--name", "t-kill"], stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    proc.kill()
    proc.wait(10)
    subprocess.run(["pddlink", "lab", "net", "down", "--name", "t-kill"], check=True, timeout=30)
    assert not leftovers("t-kill")

    code = (
        "from netlab.lab import Lab; import time; Lab.up('clean', name='t-crash'); "
        "print('up', flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None and owner.stdout.readline().strip() == "up"
    assert netns_names("t-crash")["dc-a"] in existing_netns()
    owner.kill()
    owner.wait(5)
    deadline = time.monotonic() + 10
    while leftovers("t-crash") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftovers("t-crash")


def test_two_labs_at_once_are_separate(probe_script: str) -> None:
    jumbo = parse_profile("mtu_bytes = 9000\n" + profile(10.0))
    with Lab.up("clean", name="t-one") as one, Lab.up(jumbo, name="t-two") as two:
        assert one.addr("dc-b") != two.addr("dc-b") and one.netns("dc-a") != two.netns("dc-a")
        assert (one.mtu_bytes, two.mtu_bytes) == (1500, 9000)
        link = two.run(
            "dc-a", ["ip", "-o", "link", "show", "wan0"], timeout_s=10, capture_output=True, text=True
        )
        assert " mtu 9000 " in link.stdout
        with pytest.raises(InvalidInput, match="mtu_bytes"):
            two.set_profile(parse_profile(profile(10.0)))
        with pytest.raises(InvalidInput, match="already up"):
            Lab.up("clean", name="t-one")
        fast, slow = probe(one, probe_script, 200, 0.002), probe(two, probe_script, 200, 0.002)
        assert float(fast["rtt_ms_p50"]) < 5.0 < 19.0 < float(slow["rtt_ms_p50"])  # type: ignore[arg-type]


@needs_iperf3
def test_relay_capacity_without_impairment() -> None:
    with Lab.up("clean", name="t-capacity") as lab:
        rate = iperf3_mbit(lab, 3, cc="cubic")
    print(f"relay capacity, no impairment: {rate / 1000:.2f} Gbit/s")
    assert rate > 1000.0  # the issue aims at 5 Gbit/s on an idle machine; CI shares two cores


@needs_iperf3
def test_cli_up_exec_status_outage_down() -> None:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["pddlink", "lab", "net", *args], capture_output=True, text=True, timeout=60, env=env
        )

    up = cli("up", "--profile", "metro", "--name", "t-cli", "--json")
    try:
        assert up.returncode == 0, up.stderr
        desc = json.loads(up.stdout)
        assert set(desc) == {"dc-a", "dc-b"} and set(desc["dc-b"]) == {"netns", "addr"}
        ping = cli(
            "exec",
            "--name",
            "t-cli",
            "dc-a",
            "--",
            sys.executable,
            "-c",
            "import socket; print(socket.gethostname())",
        )
        assert ping.returncode == 0
        addr = cli("exec", "--name", "t-cli", "dc-b", "--", "ip", "-4", "-o", "addr", "show", "wan0")
        assert desc["dc-b"]["addr"] in addr.stdout
        status = json.loads(cli("status", "--name", "t-cli", "--json").stdout)
        assert status["labs"]["t-cli"]["profile"] == "metro"
        assert cli("outage", "--name", "t-cli", "--seconds", "2").returncode == 0
        assert (
            json.loads(cli("status", "--name", "t-cli", "--json").stdout)["labs"]["t-cli"]["outage"] is True
        )
        assert cli("profile", "--name", "t-cli", "wan-1000km").returncode == 0
        bad = cli("profile", "--name", "t-cli", "nonexistent-profile")
        assert bad.returncode != 0 and "built-in" in bad.stderr
    finally:
        assert cli("down", "--name", "t-cli").returncode == 0
    assert cli("down", "--name", "t-cli").returncode == 0
    assert not leftovers("t-cli")
