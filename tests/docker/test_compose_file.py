"""The compose lab's files, without a container engine: compose file, role configs, entry point.

The topology is the documented one (relay on dc-a and dc-b, router/P/RLD on dc-a, MD on dc-b), every
network is internal, addresses are in 198.18.0.0/15, every role runs as the image's user with mTLS
and only its own credentials (certificate, bearer key) mounted; ``docker-compose config`` accepts
the file with the lab's variables; the role configs load with the sidecar's and the router's own
loaders and ask for credentials on every TCP port.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from netlab.compose.lab import COMPOSE_FILE, DEFAULT_CONFIG, KEY_FILE, ROLES, LabRecord
from pddlink.errors import ConfigError
from sidecar.config import load_config

yaml = pytest.importorskip("yaml")
DOCKER = Path(__file__).resolve().parents[2] / "docker"
LAB_RANGE = ipaddress.ip_network("198.18.0.0/15")


def lab_env(record: LabRecord, tmp: Path) -> dict[str, str]:
    return {
        "PDDLINK_LAB_DIR": str(tmp / "lab"),
        "PDDLINK_RUN_DIR": str(tmp / "run"),
        "PDDLINK_NET_A": record.net("dc-a"),
        "PDDLINK_NET_B": record.net("dc-b"),
        "PDDLINK_BRIDGE_A": record.bridge("dc-a"),
        "PDDLINK_BRIDGE_B": record.bridge("dc-b"),
    }


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The compose file as ``docker-compose config`` resolves it for lab slot 1 (no engine needed)."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    tmp = tmp_path_factory.mktemp("compose")
    env = {"PATH": "/usr/bin:/bin", **lab_env(LabRecord("t", 1), tmp)}
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), "--profile", "probe", "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = yaml.safe_load(out.stdout)
    return data


def test_topology_relay_joins_the_datacenters_roles_sit_in_theirs(resolved: dict[str, Any]) -> None:
    services = dict(resolved["services"])
    engines = {f"{role}-engine" for role in ("p", "rld", "md")}  # the vLLM roles' (profile vllm)
    assert set(services) == {"relay", "p", "rld", "router", "md", "probe-a", "probe-b", *engines}
    for engine in engines:  # each in its sidecar's network namespace, as in a pod
        assert services.pop(engine)["network_mode"] == f"service:{engine.removesuffix('-engine')}"
    nets = {name: set(svc["networks"]) for name, svc in services.items()}
    assert nets["relay"] == {"dc-a", "dc-b"}
    assert nets["p"] == nets["rld"] == nets["router"] == nets["probe-a"] == {"dc-a"}
    assert nets["md"] == nets["probe-b"] == {"dc-b"}
    for role in ("p", "rld", "md"):
        assert services[role]["command"] == ["pddlink", "sidecar", "--config", f"/config/{role}.toml"]
    assert services["router"]["command"][:2] == ["pddlink", "router"]
    assert services["relay"]["command"][:3] == ["python", "-m", "netlab.compose.relay"]


def test_addresses_follow_the_slot_and_stay_in_the_benchmark_range(resolved: dict[str, Any]) -> None:
    record = LabRecord("t", 1)
    for name, net in resolved["networks"].items():
        assert net["internal"] is True, name
        assert net["driver_opts"]["com.docker.network.bridge.name"] == record.bridge(name)
        (cfg,) = net["ipam"]["config"]
        assert ipaddress.ip_network(cfg["subnet"]) == ipaddress.ip_network(f"{record.net(name)}.0/24")
        assert ipaddress.ip_network(cfg["subnet"]).subnet_of(LAB_RANGE)  # type: ignore[arg-type]
    for service, svc in resolved["services"].items():
        for net in svc.get("networks", {}).values():  # (a vLLM engine has its sidecar's)
            addr = net["ipv4_address"]
            assert ipaddress.ip_address(addr) in LAB_RANGE
            if service != "relay":
                assert addr == record.addr(service), service


def test_roles_drop_root_have_their_own_credentials_and_a_route_through_the_relay(
    resolved: dict[str, Any],
) -> None:
    record = LabRecord("t", 1)
    for role in ROLES:
        svc = resolved["services"][role]
        assert svc["init"] is True
        assert svc["environment"]["PDDLINK_USER"] == "pddlink"
        assert svc["cap_add"] == ["NET_ADMIN"] and "no-new-privileges:true" in svc["security_opt"]
        dc, far = ("dc-b", "dc-a") if role == "md" else ("dc-a", "dc-b")
        assert svc["environment"]["PDDLINK_ROUTE"] == f"{record.net(far)}.0/24 via {record.net(dc)}.2"
        mounts = {v.split(":")[1]: v.split(":") for v in svc["volumes"]}  # SOURCE:TARGET[:MODE]
        assert mounts["/pki"][0].endswith(f"/lab/pki/{role}") and mounts["/pki"][2:] == ["ro"]
        assert mounts["/keys"][0].endswith(f"/lab/keys/{role}") and mounts["/keys"][2:] == ["ro"]
        assert mounts["/config"][2:] == ["ro"]
        hosts = set(svc["extra_hosts"])
        assert {f"md:{record.addr('md')}", f"p:{record.addr('p')}"} <= hosts
    relay = resolved["services"]["relay"]
    assert relay["devices"] == ["/dev/net/tun:/dev/net/tun"] and "NET_ADMIN" in relay["cap_add"]
    assert relay["sysctls"]["net.ipv4.ip_forward"] == "1"
    assert relay["sysctls"]["net.ipv4.conf.all.rp_filter"] == "0"


def test_role_configs_load_with_mtls_and_name_their_peers() -> None:
    from pddlink.cli.router import _load

    for role in ("p", "rld", "md"):
        cfg = load_config(DEFAULT_CONFIG / f"{role}.toml")
        assert cfg.role == role and cfg.tls_dir == "/pki" and cfg.host == "0.0.0.0"
        assert cfg.admin_unix == f"/run/pddlink/{role}.admin.sock"
        for addr in (cfg.peers.md_grpc, cfg.peers.md_kv, cfg.peers.rld_grpc, cfg.peers.rld_kv):
            assert addr == "" or addr.split(":")[0] in ("md", "rld")
    router, serve = _load(str(DEFAULT_CONFIG / "router.toml"), {})
    assert router.tls_dir == "/pki" and serve["unix"] == "/run/pddlink/router.sock"
    assert {router.p, router.rld, router.md} == {"p:7442", "rld:7441", "md:7440"}


def test_every_role_config_asks_for_credentials_on_every_tcp_port() -> None:
    """mTLS on gRPC and KV; a key file (mounted at /keys) on the router's HTTP API and on every
    admin port; nothing of it waived (no allow_* knob), and no key in the repository."""
    from pddlink.cli.router import load_router_config

    for role in ("p", "rld", "md"):
        cfg = load_config(DEFAULT_CONFIG / f"{role}.toml")
        assert cfg.admin_port and cfg.admin_keys_file == f"/keys/{KEY_FILE[role]}"
        assert not cfg.allow_plaintext_non_loopback and not cfg.allow_unauthenticated_non_loopback
    _, serve, api = load_router_config(str(DEFAULT_CONFIG / "router.toml"), {})
    assert serve["http_port"] == 8000 and api.api_keys_file == f"/keys/{KEY_FILE['router']}"
    text = (DEFAULT_CONFIG / "router.toml").read_text()
    assert "allow_" not in text
    assert not list(DEFAULT_CONFIG.rglob("*keys*")) and not list(DEFAULT_CONFIG.rglob("*.pem"))
    for role in ROLES:  # without its key file the same config is refused at startup
        path = DEFAULT_CONFIG / f"{role}.toml"
        if role == "router":
            with pytest.raises(ConfigError, match="allow_unauthenticated_non_loopback"):
                load_router_config(None, {**PEERS, **_without_keys(path)})
        else:
            with pytest.raises(ConfigError, match="allow_unauthenticated_non_loopback"):
                load_config(None, _without_keys(path))


PEERS = {"p": "p:7442", "rld": "rld:7441", "md": "md:7440"}


def _without_keys(path: Path) -> dict[str, Any]:
    table = tomllib.loads(path.read_text())
    table.pop("admin_keys_file", None)
    table.pop("api", None)
    return {k: v for k, v in table.items() if not isinstance(v, dict)}


def test_entrypoint_is_valid_sh_and_drops_every_capability() -> None:
    entry = DOCKER / "entrypoint.sh"
    assert subprocess.run(["sh", "-n", str(entry)], check=False).returncode == 0
    text = entry.read_text()
    assert "--inh-caps=-all" in text and "--bounding-set=-all" in text and "--no-new-privs" in text
    assert "ARG DEPS" in (DOCKER / "Dockerfile").read_text()
    assert "FROM ${BASE} AS install" in (DOCKER / "Dockerfile.deps").read_text()
