"""Sidecar configuration: TOML validated into frozen dataclasses; flags override; errors name fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from pddlink.errors import ConfigError
from sidecar.config import load_config


def test_file_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "md.toml"
    f.write_text('role = "md"\ngrpc_port = 7440\n[engine]\ndtype = "float32"\nnum_blocks = 64\n')
    cfg = load_config(f, {"engine.dtype": "float64", "grpc_port": 7441, "admin_unix": None})
    assert (cfg.role, cfg.grpc_port, cfg.engine.dtype, cfg.engine.num_blocks) == ("md", 7441, "float64", 64)
    assert cfg.name == "md0"
    with pytest.raises(AttributeError):
        cfg.role = "p"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('role = "xx"', "role must be one of"),
        ('role = "md"\ngrpc_port = 70000', "grpc_port"),
        ('role = "md"\nbogus = 1', "unknown key(s) bogus"),
        ('role = "md"\n[engine]\nblock_size = "16"', "engine]: block_size must be int"),
        ('role = "p"', "role p needs peers.md_kv"),
        ('role = "p"\n[peers]\nmd_kv = "nohost"\nmd_grpc = "a:1"', "peers.md_kv must be 'host:port'"),
        ('role = "md"\n[data_plane]\nwan_transport = "udp"', "wan_transport"),
        ("grpc_port = 1", "role is required"),
        ("role = ", "not valid TOML"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert needle in err.value.message


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config("/nonexistent/pddlink.toml")


@pytest.mark.parametrize("role", ["p", "rld", "md"])
def test_compose_lab_configs_load(role: str) -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "docker" / "config" / f"{role}.toml")
    assert cfg.role == role and cfg.engine.dtype == "float64"


def test_router_config_file_and_flags(tmp_path: Path) -> None:
    from pddlink.cli.router import _load

    f = tmp_path / "router.toml"
    f.write_text('p = "a:1"\nrld = "b:2"\nmd = "c:3"\nhttp_port = 8000\nrtt_ms = 30\n')
    cfg, serve = _load(str(f), {"rtt_ms": 12.0, "no_relay": True, "host": None})
    assert (cfg.rtt_ms, cfg.relay_enabled, serve["http_port"], serve["host"]) == (
        12.0,
        False,
        8000,
        "127.0.0.1",
    )
    f.write_text('p = "a:1"\nrld = "b:2"\nmd = "c:3"\nbogus = 1\n')
    with pytest.raises(ConfigError, match="unknown key"):
        _load(str(f), {})
    with pytest.raises(ConfigError, match="md required"):
        _load(None, {"p": "a:1", "rld": "b:2"})
