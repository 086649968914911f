"""P and RLD beside pools (issue 26): ``[peers] topology`` names every MD (and RLD) with a KV
address; a request names the instance the router placed it on (``md_identity``/``rld_identity``)
and P ships there; a name P does not know is refused typed, never shipped to the default."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engines_adapter import SamplingParams
from pddlink.errors import ConfigError, Unavailable
from sidecar.config import load_config
from sidecar.prefill import Prefiller, PrefillJob

FLEET = """
[topology]
[[topology.datacenter]]
name = "a"
p = [{ name = "p0", address = "127.0.0.1:1" }]
rld = [{ name = "r0", address = "127.0.0.1:2", kv = "127.0.0.1:12" }]
[[topology.datacenter]]
name = "b"
md = [{ name = "m0", address = "127.0.0.1:3", kv = "127.0.0.1:13" },
      { name = "m1", address = "127.0.0.1:4", kv = "127.0.0.1:14" }]
[[topology.link]]
between = ["a", "b"]
line_mbit = 10
rtt_ms = 5
"""


def test_peers_topology_is_read_relative_to_the_file_and_checked(tmp_path: Path) -> None:
    (tmp_path / "fleet.toml").write_text(FLEET)
    f = tmp_path / "p.toml"
    f.write_text('role = "p"\n[peers]\ntopology = "fleet.toml"\n')
    cfg = load_config(f)  # no md_kv / md_grpc needed beside a topology
    fleet = cfg.peers.fleet()
    assert fleet is not None and [m.instance.kv_address for m in fleet.members()][-1] == "127.0.0.1:14"
    (tmp_path / "fleet.toml").write_text(FLEET.replace('kv = "127.0.0.1:14"', 'kv = "a:1,b:2"'))
    with pytest.raises(
        ConfigError, match=r'peers.topology: topology.datacenter\[1\].md\[1\].kv: expected "host:port"'
    ):
        load_config(f)


def _job(md: str = "", rld: str = "") -> PrefillJob:
    return PrefillJob(
        "r", (1, 2, 3), SamplingParams(), True, True, False, 5.0, md_identity=md, rld_identity=rld
    )


def test_a_request_is_shipped_to_the_instance_it_names() -> None:
    layout = SimpleNamespace(model_id="m", block_size=16)
    loop: Any = SimpleNamespace(engine=SimpleNamespace(layout=layout))
    default: Any = ("default-pool", "default-md")
    m1: Any = ("m1-pool", "m1-md")
    r0: Any = ("r0-kv", "r0-grpc")
    p = Prefiller(
        loop, md_kv=default[0], md=default[1], rld_kv=None, rld=None, chunk_bytes=1 << 20, lease_s=1.0,
        md_routes={"md/m1": m1}, rld_routes={"rld/r0": r0},
    )  # fmt: skip
    assert p.md_route(_job()) == default and p.md_route(_job("md/m1")) is m1
    assert p.md_route(_job("pddlink://md/m1")) is m1
    assert p.rld_route(_job(rld="rld/r0")) is r0
    with pytest.raises(Unavailable, match="no MD peer md/m7"):
        p.md_route(_job("md/m7"))
    with pytest.raises(Unavailable, match="no RLD peer configured"):
        p.rld_route(_job())
