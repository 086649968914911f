"""The compose lab: the file parses, its topology is the one documented, and it uses only lab addresses.

No Docker engine is needed: the compose file is read as YAML (``docker compose config`` is used as
well where the client has the compose plugin).
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from netlab.netem import tc_command
from netlab.profile import builtin_profiles, load_profile

yaml = pytest.importorskip("yaml")
DOCKER = Path(__file__).resolve().parents[2] / "docker"
LAB_RANGE = ipaddress.ip_network("198.18.0.0/15")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return data


def test_topology_p_rld_router_in_dc_a_md_in_dc_b(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"gw-a", "gw-b", "p", "rld", "md", "router"}
    nets = {name: set(svc["networks"]) for name, svc in services.items()}
    assert nets["p"] == nets["rld"] == nets["router"] == {"dc-a"}
    assert nets["md"] == {"dc-b"}
    assert nets["gw-a"] == {"dc-a", "wan"} and nets["gw-b"] == {"dc-b", "wan"}
    for role in ("p", "rld", "md"):
        cmd = services[role]["command"]
        assert cmd[:4] == ["pddlink", "sidecar", "--role", role] and cmd[4:] == [
            "--config",
            f"/config/{role}.toml",
        ]
    assert services["router"]["command"][:2] == ["pddlink", "router"]


def test_every_address_is_in_the_benchmark_range_and_networks_are_internal(compose: dict[str, Any]) -> None:
    for name, net in compose["networks"].items():
        assert net["internal"] is True, name
        for cfg in net["ipam"]["config"]:
            assert ipaddress.ip_network(cfg["subnet"]).subnet_of(LAB_RANGE)  # type: ignore[arg-type]
    for svc in compose["services"].values():
        for net in svc["networks"].values():
            assert ipaddress.ip_address(net["ipv4_address"]) in LAB_RANGE


def test_gateways_shape_one_direction_each_with_a_loadable_profile(compose: dict[str, Any]) -> None:
    gws = {n: compose["services"][n]["environment"] for n in ("gw-a", "gw-b")}
    assert {g["PDDLINK_NETEM_DIRECTION"] for g in gws.values()} == {"a_to_b", "b_to_a"}
    default = gws["gw-a"]["PDDLINK_NETEM_PROFILE"].split(":-")[1].rstrip("}")
    assert default in builtin_profiles()
    for name in builtin_profiles():
        assert tc_command(load_profile(name), "a_to_b", "eth1")[5:7] == ["root", "netem"]


def test_dockerfile_and_entrypoint_are_wired(compose: dict[str, Any]) -> None:
    build = compose["x-pddlink"]["build"]
    assert ((DOCKER / build["context"]).resolve() / build["dockerfile"]).is_file()
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "COPY docker/entrypoint.sh" in dockerfile and "download.pytorch.org/whl/cpu" in dockerfile
    assert subprocess.run(["sh", "-n", str(DOCKER / "entrypoint.sh")], check=False).returncode == 0


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_compose_config_accepts_the_file() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip("the docker client has no compose plugin")
    out = subprocess.run(
        ["docker", "compose", "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
