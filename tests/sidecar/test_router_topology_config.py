"""The router's file names a topology (issue 26): a ``[topology]`` table or ``topology = "path"``,
a placement policy; the old p/rld/md form is a topology of one each; malformed ones are refused
naming the key (in the CLI: one ``error:`` line, exit code 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pddlink.cli.router import load_router_config
from pddlink.errors import ConfigError, InvalidInput
from pddlink.roles import Role

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topology" / "three-dc.toml"

TABLE = """
placement = "least_loaded"
[[topology.datacenter]]
name = "a"
p = [{ name = "p0", address = "127.0.0.1:1" }]
rld = [{ name = "r0", address = "127.0.0.1:2" }]
[[topology.datacenter]]
name = "b"
md = [{ name = "m0", address = "127.0.0.1:3" }, { name = "m1", address = "127.0.0.1:4" }]
[[topology.link]]
between = ["a", "b"]
line_mbit = 10
rtt_ms = 5
"""


def test_a_topology_table_in_the_router_file(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text(TABLE)
    cfg, _, _ = load_router_config(str(f), {})
    assert cfg.placement == "least_loaded" and cfg.topology is not None
    assert [(r, a, i) for r, a, i in cfg.sidecars() if r is Role.MD] == [
        (Role.MD, "127.0.0.1:3", "md/m0"),
        (Role.MD, "127.0.0.1:4", "md/m1"),
    ]


def test_a_topology_file_relative_to_the_router_file(tmp_path: Path) -> None:
    (tmp_path / "fleet.toml").write_text(EXAMPLE.read_text())
    f = tmp_path / "router.toml"
    f.write_text('topology = "fleet.toml"\n')
    cfg, _, _ = load_router_config(str(f), {})
    assert cfg.placement == "prefix_aware"
    assert [m.name for m in cfg.deployment().members(Role.MD)] == ["md-b0", "md-b1", "md-c0", "md-c1"]
    cfg, _, _ = load_router_config(None, {"topology": str(EXAMPLE), "placement": "prefix_hash"})
    assert len(cfg.sidecars()) == 8 and cfg.placement == "prefix_hash"


def test_the_old_form_is_a_topology_of_one_each(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('p = "127.0.0.1:1"\nrld = "127.0.0.1:2"\nmd = "127.0.0.1:3"\n')
    cfg, _, _ = load_router_config(str(f), {})
    assert cfg.topology is None
    assert cfg.sidecars() == (
        (Role.P, "127.0.0.1:1", "p/p0"),
        (Role.RLD, "127.0.0.1:2", "rld/rld0"),
        (Role.MD, "127.0.0.1:3", "md/md0"),
    )
    topo = cfg.deployment()
    assert [dc.name for dc in topo.datacenters] == ["dc-a", "dc-b"] and len(topo.links) == 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            TABLE.replace('"127.0.0.1:3"', '"a:1,b:2"'),
            'topology.datacenter[1].md[0].address: expected "host:port"',
        ),
        (TABLE.replace("rtt_ms = 5", 'rtt_ms = "5"'), "topology.link[0].rtt_ms: expected a number"),
        (TABLE.replace('name = "m1"', 'name = "m0"'), "topology.datacenter[1].md[1].name: duplicate"),
        ('p = "127.0.0.1:9"\n' + TABLE, "router: p: not with a [topology]"),
        (TABLE.replace("least_loaded", "oracle"), "router: placement must be one of"),
        ("topology = 3\n", "topology: expected a table, got an integer"),
        ('topology = "missing.toml"\n', "missing.toml"),
    ],
)
def test_a_malformed_topology_is_refused_naming_the_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "router.toml"
    f.write_text(text)
    with pytest.raises((ConfigError, InvalidInput)) as err:
        load_router_config(str(f), {})
    assert needle in str(err.value)


def test_the_router_refuses_a_malformed_topology_at_startup(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text(TABLE.replace('"127.0.0.1:3"', '["127.0.0.1:3"]'))
    cmd = [sys.executable, "-m", "pddlink", "router", "--config", str(f)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: topology.datacenter[1].md[0].address: expected a string, got a list"
    ]
