"""Secure by default (issue 16, item 2 and 7): the dev PKI keeps the CA key out of every node's
directory and sets its modes whatever the umask; nothing mints an identity silently; plaintext is
refused on a non-loopback address unless said explicitly; commands that bind or write fail with one
``error:`` line and exit code 2 (real processes, real sockets)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from pddlink.errors import ConfigError
from pddlink.listen_policy import is_loopback
from pddlink.transport import PeerIdentity, load_node, load_or_create_pki
from pddlink.transport.pki import create_ca, issue_node, node_dir
from sidecar.config import SidecarConfig, load_config

pytestmark = pytest.mark.timeout(120)
MD = PeerIdentity("md", "md0")


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_node_directories_never_hold_the_ca_key_and_modes_hold_under_umask_000(tmp_path: Path) -> None:
    with umask(0o000):
        creds = load_or_create_pki(tmp_path / "pki", [MD, PeerIdentity("router", "router0")])
    root, node = tmp_path / "pki", Path(creds[MD].cert_file).parent
    assert not list(node.glob("ca.key")) and sorted(p.name for p in node.iterdir()) == [
        "ca.pem",
        "md-md0.key",
        "md-md0.pem",
    ]
    assert [p for p in root.rglob("ca.key")] == [root / "ca" / "ca.key"]  # only in the CA's directory
    assert mode(root) == mode(root / "ca") == mode(node) == 0o700
    assert mode(root / "ca" / "ca.key") == mode(node / "md-md0.key") == 0o600
    assert mode(root / "ca" / "ca.pem") == mode(node / "ca.pem") == mode(node / "md-md0.pem") == 0o644


def test_load_node_refuses_a_directory_with_the_ca_key_a_loose_key_or_missing_files(tmp_path: Path) -> None:
    create_ca(tmp_path / "ca")
    with pytest.raises(ConfigError, match="must not be the CA"):
        issue_node(tmp_path / "ca", tmp_path / "ca", MD)
    tls = issue_node(tmp_path / "ca", tmp_path / "node", MD)
    assert load_node(tmp_path / "node", MD) == tls
    (tmp_path / "node" / "ca.key").write_bytes((tmp_path / "ca" / "ca.key").read_bytes())
    with pytest.raises(ConfigError, match="holds the CA key"):
        load_node(tmp_path / "node", MD)
    (tmp_path / "node" / "ca.key").unlink()
    os.chmod(tls.key_file, 0o644)
    with pytest.raises(ConfigError, match="readable by group or others"):
        load_node(tmp_path / "node", MD)
    with pytest.raises(ConfigError, match=r"no rld-rld0\.pem"):
        load_node(tmp_path / "node", PeerIdentity("rld", "rld0"))


def test_load_node_finds_the_ca_key_under_any_file_name(tmp_path: Path) -> None:
    """A copy of the CA's key kept as ``ca-backup.key`` (or any name) is refused as ``ca.key`` is;
    the node's own key, which is a private key too, is not mistaken for it."""
    root = tmp_path / "pki"
    load_or_create_pki(root, [MD])
    node = node_dir(root, MD)
    load_node(node, MD)  # the node's own key alone: fine
    (node / "ca-backup.key").write_bytes((root / "ca" / "ca.key").read_bytes())
    os.chmod(node / "ca-backup.key", 0o600)
    with pytest.raises(ConfigError, match=r"holds the CA key \(ca-backup.key\)"):
        load_node(node, MD)
    (node / "ca-backup.key").rename(node / "notes.txt")
    with pytest.raises(ConfigError, match=r"holds the CA key \(notes.txt\)"):
        load_node(node, MD)


def test_ping_with_a_tls_dir_never_mints_an_identity(tmp_path: Path) -> None:
    from pddlink.cli.diag import ping

    (tmp_path / "diag").mkdir()
    res = CliRunner().invoke(ping, ["127.0.0.1:1", "--tls-dir", str(tmp_path / "diag")])
    assert res.exit_code != 0 and "no diag-ping.pem" in str(res.exception)
    assert list((tmp_path / "diag").iterdir()) == []  # nothing written: no CA, no key


def test_pki_command_issues_node_directories_without_the_ca_key(tmp_path: Path) -> None:
    with umask(0o000):
        assert run_cli("pki", "init", str(tmp_path / "ca")).returncode == 0
        out = run_cli("pki", "issue", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "p"), "p/p0")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["ca.pem", "p-p0.key", "p-p0.pem"]
    assert mode(tmp_path / "p") == 0o700 and mode(tmp_path / "p" / "p-p0.key") == 0o600
    again = run_cli("pki", "init", str(tmp_path / "ca"))
    assert again.returncode == 2 and "already holds a CA" in again.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "", "198.18.0.2", "::", "md.example"])
def test_plaintext_on_a_non_loopback_address_is_refused_unless_allowed(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match="allow_plaintext_non_loopback"):
        SidecarConfig(role="md", host=host)
    assert SidecarConfig(role="md", host=host, allow_plaintext_non_loopback=True).host == host
    assert SidecarConfig(role="md", host=host, tls_dir="/some/node/dir").host == host


def test_loopback_plaintext_and_the_config_key() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert is_loopback(host) and SidecarConfig(role="md", host=host).host == host
    cfg = load_config(None, {"role": "md", "host": "0.0.0.0", "allow_plaintext_non_loopback": True})
    assert cfg.allow_plaintext_non_loopback


def test_router_refuses_plaintext_on_a_non_loopback_address() -> None:
    from pddlink.cli.router import _load

    peers = {"p": "127.0.0.1:1", "rld": "127.0.0.1:2", "md": "127.0.0.1:3"}
    with pytest.raises(ConfigError, match="allow_plaintext_non_loopback"):
        _load(None, {**peers, "host": "0.0.0.0"})
    _, serve = _load(None, {**peers, "host": "0.0.0.0", "allow_plaintext_non_loopback": True})
    assert serve["host"] == "0.0.0.0"


# -- friendly errors: real processes ------------------------------------------------------------------


def run_cli(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pddlink.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def assert_one_line(res: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


ROUTER = ["router", "--p", "127.0.0.1:1", "--rld", "127.0.0.1:2", "--md", "127.0.0.1:3"]


def test_port_in_use_is_one_line_for_sidecar_and_router(busy_port: int) -> None:
    for argv in (
        ["sidecar", "--role", "md", "--grpc-port", str(busy_port)],
        ["sidecar", "--role", "md", "--kv-port", str(busy_port)],
        ["sidecar", "--role", "md", "--admin-port", str(busy_port)],
        [*ROUTER, "--grpc-port", str(busy_port)],
        [*ROUTER, "--http-port", str(busy_port)],
    ):
        assert_one_line(run_cli(*argv), "already in use", str(busy_port))


def test_an_address_that_is_not_local_is_one_line() -> None:
    for argv in (
        ["sidecar", "--role", "md", "--host", "10.255.255.1", "--allow-plaintext-non-loopback"],
        [*ROUTER, "--host", "10.255.255.1", "--allow-plaintext-non-loopback"],
        ["sidecar", "--role", "md", "--host", "no-such-host.invalid", "--allow-plaintext-non-loopback"],
    ):
        assert_one_line(run_cli(*argv), "10.255.255.1" if "10.255.255.1" in argv else "cannot resolve")


def test_an_unwritable_directory_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"  # below a regular file nothing can be written, not even by root
    blocker.write_text("x")
    below = blocker / "sub"
    cases = [
        (["sidecar", "--role", "md", "--admin-unix", str(below / "md.sock")], "cannot write"),
        ([*ROUTER, "--unix", str(below / "router.sock")], "cannot write"),
        (["demo", "--requests", "1", "--json", str(below / "demo.json")], "cannot write"),
        (["pki", "init", str(below / "ca")], "cannot write"),
        (["pki", "issue", "--ca", str(tmp_path), "--out", str(below), "p/p0"], "cannot write"),
        (["sidecar", "--role", "md", "--tls-dir", str(tmp_path / "empty")], "no md-md0.pem"),
    ]
    for argv, words in cases:
        assert_one_line(run_cli(*argv), words)


def test_a_live_unix_socket_is_not_taken_over(tmp_path: Path) -> None:
    path = str(tmp_path / "admin.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        s.listen(1)
        assert_one_line(run_cli("sidecar", "--role", "md", "--admin-unix", path), "already serves")


def test_the_router_sockets_are_owner_only_under_umask_000(tmp_path: Path) -> None:
    sock = tmp_path / "router.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pddlink.cli.main", *ROUTER, "--unix", str(sock)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.umask(0),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read() if proc.stderr else ""
        for path in (sock, Path(f"{sock}.grpc")):
            assert stat.S_ISSOCK(path.stat().st_mode) and mode(path) & 0o077 == 0, oct(mode(path))
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_sidecar_admin_socket_is_0600_under_umask_000(tmp_path: Path) -> None:
    sock = tmp_path / "md.admin.sock"
    argv = ["sidecar", "--role", "md", "--admin-unix", str(sock), "--num-blocks", "64"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pddlink.cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: os.umask(0),
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        line = ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("READY")
        assert stat.S_ISSOCK(sock.stat().st_mode) and mode(sock) == 0o600, oct(mode(sock))
    finally:
        proc.terminate()
        proc.wait(10)
