"""The Kubernetes manifests (docker/k8s/) pass offline validation against the Kubernetes API schemas
(``kubernetes-validate``, strict: unknown fields fail) and follow the sidecar pattern. No cluster
runs here: validated, not deployed."""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")
K8S = Path(__file__).resolve().parents[2] / "docker" / "k8s"
VERSION = "1.37.0"


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def test_every_manifest_validates_strictly_against_the_api_schemas() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} == {"Namespace", "ConfigMap", "Deployment", "Service"}
    for doc in docs:
        kv.validate(doc, VERSION, strict=True)


def test_the_validation_rejects_a_broken_manifest() -> None:
    bad = copy.deepcopy(by_kind("Deployment")["pddlink-md"])
    bad["spec"]["template"]["spec"]["containers"][1]["ports"][0]["containerPort"] = "seven"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, VERSION, strict=True)
    unknown = copy.deepcopy(by_kind("Service")["pddlink-md"])
    unknown["spec"]["portz"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(unknown, VERSION, strict=True)


def test_engine_pods_pair_the_engine_with_the_sidecar_ready_on_readyz_with_secret_certificates() -> None:
    deployments = by_kind("Deployment")
    assert set(deployments) == {"pddlink-p", "pddlink-rld", "pddlink-md", "pddlink-router"}
    for role in ("p", "rld", "md"):
        pod = deployments[f"pddlink-{role}"]["spec"]["template"]["spec"]
        engine, sidecar = pod["containers"]
        assert (engine["name"], sidecar["name"]) == ("engine", "pddlink")
        assert sidecar["args"] == ["pddlink", "sidecar", "--config", f"/config/{role}.toml"]
        assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
        assert {m["mountPath"] for m in engine["volumeMounts"]} >= {"/dev/shm", "/run/pddlink"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["pki"]["secret"]["secretName"] == f"pddlink-tls-{role}"
        assert volumes["keys"]["secret"] == {"secretName": f"pddlink-keys-{role}", "defaultMode": 0o400}
        assert {"name": "keys", "mountPath": "/keys", "readOnly": True} in sidecar["volumeMounts"]
        assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}  # keyless
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_services_expose_the_data_plane_and_mds_drc_feed() -> None:
    services = by_kind("Service")
    ports = {name: {p["name"]: p["port"] for p in svc["spec"]["ports"]} for name, svc in services.items()}
    # vLLM's sidecars serve no gRPC: the router talks to each vLLM's API (engine), P ships to kv
    assert ports["pddlink-md"] == {"engine": 8100, "kv": 7450, "admin": 7460}
    assert ports["pddlink-rld"] == {"engine": 8100, "kv": 7451, "admin": 7461}
    assert ports["pddlink-p"] == {"engine": 8100, "admin": 7462}
    assert ports["pddlink-router"] == {"grpc": 7443, "http": 8000}


def test_configmap_files_load_as_role_configs_with_mtls() -> None:
    import tomllib

    from sidecar.config import load_config

    data = by_kind("ConfigMap")["pddlink-config"]["data"]
    for role in ("p", "rld", "md"):
        cfg = load_config(None, tomllib.loads(data[f"{role}.toml"]))
        assert cfg.role == role and cfg.tls_dir == "/pki" and cfg.engine_kind == "vllm"
        assert cfg.admin_port and cfg.admin_keys_file == "/keys/admin-keys"  # the admin port takes keys
    assert tomllib.loads(data["router.toml"])["tls_dir"] == "/pki"


def test_each_vllm_engine_runs_beside_a_vllm_sidecar_with_the_arguments_it_prints(tmp_path: Path) -> None:
    """The pairing the layout check asks for: a container running PddlinkConnector sits beside a
    sidecar whose file says engine = "vllm", and its arguments carry exactly what that sidecar's
    ``--print-vllm-args`` prints (the control socket, the block size, the event endpoint)."""
    from click.testing import CliRunner

    from engines_adapter.vllm.connector_config import require_in_process_engine
    from pddlink.cli.main import cli

    data = by_kind("ConfigMap")["pddlink-config"]["data"]
    for role in ("p", "rld", "md"):
        pod = by_kind("Deployment")[f"pddlink-{role}"]["spec"]["template"]["spec"]
        engine, sidecar = pod["containers"]
        assert any("PddlinkConnector" in a for a in engine["args"])
        name = sidecar["args"][-1].rsplit("/", 1)[1]
        assert re.search(r'^engine = "vllm"$', data[name], re.M), f"{role}: the sidecar's file is not vLLM's"
        (tmp_path / name).write_text(data[name])
        out = CliRunner().invoke(cli, ["sidecar", "--config", str(tmp_path / name), "--print-vllm-args"])
        assert out.exit_code == 0, out.output
        words = out.output.split()
        at = engine["args"].index(words[0])
        assert engine["args"][at : at + len(words)] == words
        assert {k: v for k, v in engine["env"][0].items() if k == "name"} == {"name": "VLLM_API_KEY"}
        # the connector refuses vLLM's default VLLM_ENABLE_V1_MULTIPROCESSING=1 (connector_config)
        env = {e["name"]: e.get("value") for e in engine["env"]}
        require_in_process_engine({k: v for k, v in env.items() if v is not None})
    router = tomllib.loads(data["router.toml"])
    assert router["engine"] == "vllm" and router["vllm"]["api_key_file"] == "/keys/vllm-api-key"


def test_the_router_pod_takes_api_keys_and_its_probe_needs_none(tmp_path: Path) -> None:
    from pddlink.cli.router import load_router_config

    data = by_kind("ConfigMap")["pddlink-config"]["data"]
    (tmp_path / "router.toml").write_text(data["router.toml"])
    _, serve, api = load_router_config(str(tmp_path / "router.toml"), {})
    assert serve["http_port"] == 8000 and api.api_keys_file == "/keys/api-keys" and not api.http_mtls
    pod = by_kind("Deployment")["pddlink-router"]["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/healthz"  # the one keyless path
    assert {v["name"]: v for v in pod["volumes"]}["keys"]["secret"]["secretName"] == "pddlink-keys-router"
    assert {"name": "keys", "mountPath": "/keys", "readOnly": True} in router["volumeMounts"]
