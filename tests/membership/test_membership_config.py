"""``[membership]`` in the sidecar's and the router's files: off by default (nothing to start), and
when on, refused without mutual TLS (a record names whom to expect, only TLS proves it), a sidecar
without its datacenter, and a router given a sidecar's keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from pddlink.cli.router import load_router_config
from pddlink.errors import ConfigError
from sidecar.config import load_config

TOPOLOGY = """
[topology]
[[topology.datacenter]]
name = "dc-a"
p = [{ name = "p-a0", address = "127.0.0.1:1" }]
[[topology.datacenter]]
name = "dc-b"
md = [{ name = "md-b0", address = "127.0.0.1:3" }]
[[topology.link]]
between = ["dc-a", "dc-b"]
line_mbit = 100
rtt_ms = 2
"""


def _sidecar(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "md.toml"
    path.write_text('role = "md"\npeer_id = "md-b0"\n' + text)
    return path


def _router(tmp_path: Path, text: str) -> Path:
    (tmp_path / "fleet.toml").write_text(TOPOLOGY)
    path = tmp_path / "router.toml"
    path.write_text('topology = "fleet.toml"\n' + text)
    return path


def test_off_by_default(tmp_path: Path) -> None:
    assert not load_config(_sidecar(tmp_path, "")).membership.enabled
    cfg, _, _ = load_router_config(str(_router(tmp_path, "")), {})
    assert not cfg.membership.enabled


def test_a_sidecar_announces_with_tls_and_its_datacenter(tmp_path: Path) -> None:
    on = '[membership]\netcd = "127.0.0.1:2379"\ncluster = "prod"\ndatacenter = "dc-b"\nttl_s = 4\n'
    cfg = load_config(_sidecar(tmp_path, 'tls_dir = "/tls"\n' + on))
    m = cfg.membership
    assert (m.enabled, m.datacenter, m.registrar_config().ttl_s) == (True, "dc-b", 4)
    assert m.keys().members_prefix == b"/pddlink/prod/members/"
    with pytest.raises(ConfigError, match="needs tls_dir"):
        load_config(_sidecar(tmp_path, on))
    with pytest.raises(ConfigError, match="datacenter is required"):
        load_config(_sidecar(tmp_path, 'tls_dir = "/tls"\n[membership]\netcd = "127.0.0.1:2379"\n'))
    with pytest.raises(ConfigError, match="ttl_s"):
        load_config(_sidecar(tmp_path, 'tls_dir = "/tls"\n' + on.replace("ttl_s = 4", "ttl_s = 1")))
    with pytest.raises(ConfigError, match="host:port"):
        load_config(_sidecar(tmp_path, 'tls_dir = "/tls"\n' + on.replace("127.0.0.1:2379", "etcd")))


def test_a_router_follows_with_tls_and_refuses_a_sidecars_keys(tmp_path: Path) -> None:
    on = '[membership]\netcd = "127.0.0.1:2379,127.0.0.2:2379"\ncluster = "prod"\n'
    cfg, _, _ = load_router_config(str(_router(tmp_path, 'tls_dir = "/tls"\n' + on)), {})
    assert cfg.membership.etcd_config().endpoints == ("127.0.0.1:2379", "127.0.0.2:2379")
    with pytest.raises(ConfigError, match="needs tls_dir"):
        load_router_config(str(_router(tmp_path, on)), {})
    with pytest.raises(ConfigError, match="datacenter"):
        load_router_config(str(_router(tmp_path, 'tls_dir = "/tls"\n' + on + 'datacenter = "dc-a"\n')), {})
