"""Credentials on the HTTP ports (issue 16, item 2): the router's client API and a sidecar's admin
port bound to a non-loopback address without credentials are refused at startup unless said
explicitly (``allow_unauthenticated_non_loopback``); a sidecar's admin TCP port with keys answers
only /healthz and /readyz without one, 401 for the rest; its unix socket stays keyless. Config
checks in process, then real processes and sockets."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cluster import free_port
from pddlink.errors import ConfigError
from pddlink.listen_policy import check_open_http
from pddlink.serving.admin_access import OPEN_PATHS, admin_refusal
from pddlink.serving.client_guard import bearer_client, load_key_file, write_key_file
from pddlink.serving.http import Request, fetch
from sidecar.config import SidecarConfig
from tests.sidecar.test_secure_defaults import ROUTER, assert_one_line, run_cli

pytestmark = pytest.mark.timeout(180)
PEERS = {"p": "127.0.0.1:1", "rld": "127.0.0.1:2", "md": "127.0.0.1:3"}
KNOB = "allow_unauthenticated_non_loopback"


@pytest.mark.parametrize("host", ["0.0.0.0", "", "198.18.0.2", "::", "router.example"])
def test_an_open_http_port_on_a_non_loopback_address_is_refused_unless_allowed(host: str) -> None:
    with pytest.raises(ConfigError, match=KNOB):
        check_open_http(host, guarded=False, allowed=False, who="x", remedy="keys")
    check_open_http(host, guarded=True, allowed=False, who="x", remedy="keys")
    check_open_http(host, guarded=False, allowed=True, who="x", remedy="keys")
    for loopback in ("127.0.0.1", "::1", "localhost"):
        check_open_http(loopback, guarded=False, allowed=False, who="x", remedy="keys")


def test_router_refuses_an_http_api_without_keys_or_mtls_on_a_non_loopback_address(tmp_path: Path) -> None:
    from pddlink.cli.router import load_router_config

    base = {**PEERS, "host": "0.0.0.0", "tls_dir": "/some/node/dir", "http_port": 8000}
    with pytest.raises(ConfigError, match=f"router HTTP API.*api_keys_file.*{KNOB}"):
        load_router_config(None, base)
    keys = tmp_path / "api-keys"
    write_key_file(keys)
    for ok in ({"api_keys_file": str(keys)}, {"http_mtls": True}, {KNOB: True}, {"http_port": 0}):
        _, serve, _ = load_router_config(None, {**base, **ok})
        assert serve["host"] == "0.0.0.0"
    _, serve, _ = load_router_config(None, {**base, "host": "127.0.0.1"})  # loopback: keyless is fine
    assert serve["http_port"] == 8000
    f = tmp_path / "router.toml"
    f.write_text(f'{KNOB} = true\nhost = "0.0.0.0"\nhttp_port = 8000\ntls_dir = "/x"\n')
    assert load_router_config(str(f), PEERS)[1]["host"] == "0.0.0.0"
    f.write_text(f'{KNOB} = "yes"\n')
    with pytest.raises(ConfigError, match=f"{KNOB} must be true or false"):
        load_router_config(str(f), PEERS)


def test_sidecar_refuses_an_admin_port_without_keys_on_a_non_loopback_address() -> None:
    base = {"role": "md", "host": "0.0.0.0", "tls_dir": "/some/node/dir"}
    with pytest.raises(ConfigError, match=f"sidecar admin port.*admin_keys_file.*{KNOB}"):
        SidecarConfig(**base, admin_port=7460)  # type: ignore[arg-type]
    assert SidecarConfig(**base, admin_port=7460, admin_keys_file="/keys/admin-keys").admin_port == 7460  # type: ignore[arg-type]
    assert SidecarConfig(**base, admin_port=7460, allow_unauthenticated_non_loopback=True).admin_port  # type: ignore[arg-type]
    assert SidecarConfig(**base, admin_unix="/run/x.sock").admin_port == 0  # type: ignore[arg-type]
    assert SidecarConfig(role="md", admin_port=7460).host == "127.0.0.1"  # loopback: keyless is fine


def test_key_files_are_0600_whatever_the_umask_and_never_overwritten(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        key = write_key_file(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600 and len(key) >= 32
    assert load_key_file(str(tmp_path / "k"), "admin_keys_file") == (key.encode(),)
    with pytest.raises(FileExistsError):
        write_key_file(tmp_path / "k")
    res = run_cli("pki", "key", str(tmp_path / "k"))
    assert_one_line(res, "never overwritten")
    assert run_cli("pki", "key", str(tmp_path / "new" / "k2")).returncode == 0
    assert stat.S_IMODE((tmp_path / "new" / "k2").stat().st_mode) == 0o600


KEY = b"k" * 20


def req(path: str, auth: str | None = None, method: str = "GET") -> Request:
    headers = (("authorization", auth),) if auth is not None else ()
    return Request(method, path, "", b"", headers, "10.0.0.9")


@pytest.mark.parametrize(
    ("request_", "refused"),
    [
        (req("/healthz"), False),
        (req("/readyz"), False),
        (req("/status"), True),
        (req("/metrics"), True),
        (req("/memory"), True),
        (req("/drc/snapshot"), True),
        (req("/drc/match", method="POST"), True),
        (req("/healthz", method="POST"), True),  # only the probes' GET is open
        (req("/status", "Bearer " + "x" * 20), True),
        (req("/status", "Basic " + KEY.decode()), True),
        (req("/status", "Bearer " + KEY.decode()), False),
        (req("/drc/match", "bearer  " + KEY.decode(), "POST"), False),
    ],
)
def test_admin_access_table(request_: Request, refused: bool) -> None:
    refusal = admin_refusal((KEY,), request_)
    assert (refusal is not None) is refused
    if refusal is not None:
        assert refusal.status == 401
    assert admin_refusal((), request_) is None  # no keys (loopback only): open
    assert {"/healthz", "/readyz"} == OPEN_PATHS


def test_bearer_client_names_a_client_by_a_hash_of_its_key() -> None:
    who = bearer_client((KEY, b"m" * 20), "Bearer " + "m" * 20)
    assert isinstance(who, str) and who.startswith("key:") and "m" * 8 not in who


# -- real processes ---------------------------------------------------------------------------------


def test_the_commands_refuse_open_http_on_a_non_loopback_address_in_one_line(tmp_path: Path) -> None:
    port = str(free_port())
    for argv in (
        [*ROUTER, "--host", "0.0.0.0", "--http-port", port, "--allow-plaintext-non-loopback"],
        [
            "sidecar",
            "--role",
            "md",
            "--host",
            "0.0.0.0",
            "--admin-port",
            port,
            "--allow-plaintext-non-loopback",
        ],
    ):
        assert_one_line(run_cli(*argv), KNOB)
    missing = str(tmp_path / "no-such-keys")
    argv = ["sidecar", "--role", "md", "--admin-port", port, "--admin-keys-file", missing]
    assert_one_line(run_cli(*argv), "admin_keys_file", "no-such-keys")


@pytest.fixture(scope="module")
def md_admin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """An MD sidecar with an admin TCP port and keys, and its keyless unix socket: (tcp, unix, key)."""
    tmp = tmp_path_factory.mktemp("admin")
    key = write_key_file(tmp / "admin-keys")
    port, sock = free_port(), tmp / "md.admin.sock"
    argv = ["sidecar", "--role", "md", "--num-blocks", "64", "--admin-port", str(port)]
    argv += ["--admin-keys-file", str(tmp / "admin-keys"), "--admin-unix", str(sock)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pddlink.cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline, line = time.monotonic() + 90, ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("READY"), line
        yield f"127.0.0.1:{port}", f"unix:{sock}", key
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_admin_tcp_port_answers_only_the_probes_without_a_key(md_admin: tuple[str, str, str]) -> None:
    tcp, _, key = md_admin
    for path in ("/healthz", "/readyz"):
        assert fetch(tcp, "GET", path)[0] == 200
    for method, path in (
        ("GET", "/status"),
        ("GET", "/metrics"),
        ("GET", "/memory"),
        ("GET", "/drc/stats"),
        ("GET", "/drc/snapshot"),
        ("POST", "/drc/match"),
        ("GET", "/no-such-thing"),
    ):
        body = b'{"tokens": [1, 2, 3]}' if method == "POST" else b""
        code, text = fetch(tcp, method, path, body)
        assert code == 401 and b"API key" in text, (path, code, text)
        assert fetch(tcp, method, path, body, bearer="x" * 43)[0] == 401
        assert fetch(tcp, method, path, body, bearer=key)[0] != 401
    code, text = fetch(tcp, "GET", "/status", bearer=key)
    assert code == 200 and json.loads(text)["role"] == "md"
    assert fetch(tcp, "POST", "/drc/match", b'{"tokens": [1, 2, 3]}', bearer=key)[0] == 200


def test_the_admin_unix_socket_needs_no_key(md_admin: tuple[str, str, str]) -> None:
    _, unix, _ = md_admin
    for path in ("/status", "/metrics", "/drc/stats"):
        assert fetch(unix, "GET", path)[0] == 200, path


def test_pddlink_status_sends_the_key_file(md_admin: tuple[str, str, str], tmp_path: Path) -> None:
    tcp, unix, key = md_admin
    without = run_cli("status", "--json", tcp)
    assert json.loads(without.stdout)[tcp] == {"error": "HTTP 401"}
    assert run_cli("status", tcp).returncode == 1
    (tmp_path / "k").write_text(f"# the operator's key\n{key}\n")
    with_key = run_cli("status", "--json", "--key-file", str(tmp_path / "k"), tcp, unix)
    assert with_key.returncode == 0, with_key.stderr
    assert {doc["role"] for doc in json.loads(with_key.stdout).values()} == {"md"}
