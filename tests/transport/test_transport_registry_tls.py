"""Registry (lazy load, clear Unavailable, fast-path choice), dev PKI and identities, bench CLI output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from pddlink.errors import InvalidInput, Unavailable
from pddlink.transport import registry
from pddlink.transport.pki import load_or_create_peer
from pddlink.transport.tls import (
    AuthError,
    PeerIdentity,
    check_peer,
    identity_from_certificate,
)


def test_registry_loads_by_name_and_refuses_unknown_names() -> None:
    assert registry.load("tcp").name == "tcp"
    assert registry.load("quic").name == "quic"
    with pytest.raises(InvalidInput, match="unknown transport 'carrier-pigeon'"):
        registry.load("carrier-pigeon")


def test_missing_optional_dependency_fails_only_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = registry.TransportEntry("pddlink_test_missing_module:Thing", "pip install thing")
    monkeypatch.setitem(registry.TRANSPORTS, "thing", entry)
    with pytest.raises(Unavailable, match="needs pddlink_test_missing_module: install pip install thing"):
        registry.load("thing")
    assert registry.load("tcp").name == "tcp"  # the others are unaffected


def test_auto_uses_tcp_without_an_rdma_device_and_says_why(tmp_path: Path) -> None:
    choice = registry.choose_fast_path(tmp_path / "no-such-sysfs")
    assert choice.name == "tcp" and not choice.rdma_available and "no RDMA device" in choice.reason


def test_auto_with_a_device_but_no_pyverbs_falls_back_with_the_install_hint(tmp_path: Path) -> None:
    pytest.importorskip("pddlink.transport.rdma")
    try:
        import pyverbs  # noqa: F401

        pytest.skip("pyverbs is installed here")
    except ImportError:
        pass
    (tmp_path / "mlx5_0").mkdir()
    choice = registry.choose_fast_path(tmp_path)
    assert choice.name in ("tcp", "rdma")
    if choice.name == "tcp":
        assert not choice.rdma_available and "mlx5_0" in choice.reason


def test_pki_is_created_once_and_reused(tmp_path: Path) -> None:
    first = load_or_create_peer(tmp_path, PeerIdentity("rld", "rld-0"))
    second = load_or_create_peer(tmp_path, PeerIdentity("rld", "rld-0"))
    assert first == second and first.cert_file.read_bytes() == second.cert_file.read_bytes()
    assert oct(first.key_file.stat().st_mode & 0o777) == "0o600"
    cert = x509.load_pem_x509_certificate(first.cert_file.read_bytes())
    assert identity_from_certificate(cert) == PeerIdentity("rld", "rld-0")
    cert.verify_directly_issued_by(first.ca_certificate())


def test_identity_parsing_and_checks() -> None:
    assert (
        PeerIdentity.parse("pddlink://md/md-1") == PeerIdentity("md", "md-1") == PeerIdentity.parse("md/md-1")
    )
    for bad in ("md", "pddlink://md/", "/x", "a/b/c"):
        with pytest.raises(InvalidInput):
            PeerIdentity.parse(bad)
    with pytest.raises(AuthError, match="claims"):
        check_peer(PeerIdentity("p", "a"), claimed=PeerIdentity("p", "b"))
    with pytest.raises(AuthError, match="expected"):
        check_peer(PeerIdentity("p", "a"), expected=PeerIdentity("md", "a"))
    check_peer(PeerIdentity("p", "a"), claimed=PeerIdentity("p", "a"), expected=PeerIdentity("p", "a"))


@pytest.mark.process
def test_bench_link_prints_one_json_object_with_the_agreed_keys() -> None:
    argv = [sys.executable, "-m", "pddlink.cli.main", "bench", "link", "--transport", "tcp", "--streams", "2",
            "--bytes", "20000000", "--chunk-bytes", "1048576", "--tls", "--json"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    result = json.loads(out)
    assert set(result) >= {"transport", "streams", "bytes", "seconds", "goodput_gbit_per_s", "cpu_s_per_gb",
                           "retransmits"}  # fmt: skip
    assert result["transport"] == "tcp" and result["streams"] == 2 and result["bytes"] == 20_000_000
    assert result["goodput_gbit_per_s"] > 0 and result["tls"] is True
