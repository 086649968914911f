"""The router's TOML file with its [api] table, and every example configuration of examples/deploy."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pddlink.cli.router import load_router_config
from pddlink.errors import ConfigError
from pddlink.serving.client_guard import ApiConfig
from sidecar.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"


@pytest.mark.parametrize("lab", ["loopback", "netns"])
def test_example_configs_load(lab: str) -> None:
    for role in ("md", "rld", "p"):
        cfg = load_config(DEPLOY / lab / f"{role}.toml")
        assert cfg.role == role and cfg.tls_dir and cfg.admin_port == 0  # mTLS, no admin TCP port
    cfg, serve, api = load_router_config(str(DEPLOY / lab / "router.toml"), {"md": "127.0.0.1:1"})
    assert cfg.tls_dir and cfg.md == "127.0.0.1:1" and serve["http_port"] == 28000
    assert isinstance(api, ApiConfig) and api.api_keys_file and api.tokenizer and api.model == "tiny"


def test_api_table_is_checked(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    base = 'p = "a:1"\nrld = "b:2"\nmd = "c:3"\n'
    f.write_text(base + "[api]\nmax_body_bytes = 4096\nrate_per_client_s = 2\n")
    _, _, api = load_router_config(str(f), {})
    assert api.max_body_bytes == 4096 and api.rate_per_client_s == 2.0
    for bad, needle in (
        ("[api]\nmax_bodybytes = 1\n", "unknown key(s) max_bodybytes"),
        ('[api]\nmax_body_bytes = "1"\n', "max_body_bytes must be int"),
        ("[api]\nhttp_mtls = 1\n", "http_mtls must be bool"),
        ("[api]\nmax_body_bytes = 0\n", "api.max_body_bytes must be >= 1"),
        ("[api]\nbody_timeout_s = 0\n", "api.body_timeout_s"),
        ("api = 3\n", "[api] must be a table"),
    ):
        f.write_text(base + bad)
        with pytest.raises(
            ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
        ):
            load_router_config(str(f), {})


def test_flags_override_the_api_table(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('p = "a:1"\nrld = "b:2"\nmd = "c:3"\n[api]\nmodel = "m1"\n')
    _, _, api = load_router_config(str(f), {"model": "m2", "tokenizer": None})
    assert api.model == "m2" and api.tokenizer == ""


def test_api_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# ops\nshort\n")
    with pytest.raises(ConfigError, match="16 characters"):
        ApiConfig(api_keys_file=str(keys)).load_keys()
    keys.write_text("# none\n\n")
    with pytest.raises(ConfigError, match="no keys"):
        ApiConfig(api_keys_file=str(keys)).load_keys()
    with pytest.raises(ConfigError, match="api_keys_file"):
        ApiConfig(api_keys_file=str(tmp_path / "missing")).load_keys()


def test_vllm_engine_config_loads_and_is_checked(tmp_path: Path) -> None:
    """``engine = "vllm"``: the [vllm] table names the servers; p/rld/md are not needed then."""
    from pddlink.errors import InvalidInput
    from router import Router

    cfg, serve, api = load_router_config(str(DEPLOY / "vllm" / "router.toml"), {})
    assert cfg.engine == "vllm" and cfg.vllm.md_url.startswith("http://") and cfg.vllm.rld_gets_kv
    assert serve["http_port"] == 28000 and api.model == "tiny" and cfg.tls_dir == "run/pki/router"
    router = Router(dataclasses.replace(cfg, tls_dir=""))  # the example's PKI is made by docs/deploy.md
    assert router.backend.status()["engine"] == "vllm"
    asyncio.run(router.close())
    f = tmp_path / "router.toml"
    bad = {
        'engine = "vllm"\n[vllm]\np_url = "http://a:1"\nmd_url = "http://b"\nmodel = "m"\nnope = 1\n': "nope",
        'engine = "vllm"\n[vllm]\np_url = "http://a:1"\nmodel = "m"\n': "md_url",
        'engine = "vllm"\n[vllm]\np_url = 3\n': "p_url must be str",
        'engine = "sglang"\n': "engine must be one of",
        'engine = "reference"\n': "required",
    }
    for text, words in bad.items():
        f.write_text(text)
        with pytest.raises((ConfigError, InvalidInput), match=words):
            load_router_config(str(f), {})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('p = ["127.0.0.1:1", "127.0.0.1:2"]', "error: router: p: expected a string, got list"),
        ('p = "a:1,b:2"', 'error: p: expected "host:port", got "a:1,b:2"'),
    ],
)
def test_a_malformed_address_is_refused_at_startup_naming_the_key(
    tmp_path: Path, line: str, message: str
) -> None:
    """Issue 26: a list for p crashed the router with a traceback; "a:1,b:2" was taken and then left a
    completion unanswered for 25 s. Both now end the start with one error line, exit code 2."""
    cfg = tmp_path / "router.toml"
    cfg.write_text(f'{line}\nrld = "127.0.0.1:3"\nmd = "127.0.0.1:4"\n')
    out = subprocess.run(
        [sys.executable, "-m", "pddlink", "router", "--config", str(cfg)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [message] or out.stderr.strip().splitlines()[-1].startswith(
        message
    )
    assert "Traceback" not in out.stderr
