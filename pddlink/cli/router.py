"""``pddlink router``: the client API, pipeline policy and stream merging in front of P, RLD, MD."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import click

from pddlink.errors import ConfigError
from pddlink.listen_policy import check_open_http, check_plaintext_exposure
from pddlink.roles import SIDECAR_ROLES

# flag -> (RouterConfig field or serving option, type)
_SERVE = {"host": str, "grpc_port": int, "http_port": int, "unix": str}
_ALLOW_PLAINTEXT = "allow_plaintext_non_loopback"
_ALLOW_UNAUTHENTICATED = "allow_unauthenticated_non_loopback"


_API_FLAGS = ("model", "tokenizer", "api_keys_file", "http_mtls")


def _api(table: dict[str, Any], flags: dict[str, Any]) -> Any:
    """The ``[api]`` table (``pddlink.serving.client_guard.ApiConfig``), flags overriding it."""
    from pddlink.serving.client_guard import ApiConfig

    api = table.pop("api", {})
    if not isinstance(api, dict):
        raise ConfigError("router config: [api] must be a table")
    api.update({k: flags.pop(k) for k in _API_FLAGS if flags.get(k) is not None})
    known = set(ApiConfig.__dataclass_fields__)
    unknown = set(api) - known
    if unknown:
        raise ConfigError(f"router config [api]: unknown key(s) {', '.join(sorted(unknown))}")
    for key, value in api.items():
        want = ApiConfig.__dataclass_fields__[key].type
        kinds: dict[str, Any] = {"int": int, "float": (int, float), "str": str, "bool": bool}
        ok = kinds[str(want)]
        if not isinstance(value, ok) or (want != "bool" and isinstance(value, bool)):
            raise ConfigError(f"router config [api]: {key} must be {want}, got {value!r}")
    for key in _API_FLAGS:
        flags.pop(key, None)
    fields = ApiConfig.__dataclass_fields__
    kwargs: dict[str, Any] = {k: float(v) if fields[k].type == "float" else v for k, v in api.items()}
    return ApiConfig(**kwargs)


def load_router_config(config_path: str | None, flags: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """(RouterConfig, serving options, ApiConfig) from the TOML file and flags."""
    table: dict[str, Any] = {}
    if config_path:
        try:
            table = tomllib.loads(Path(config_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"router config {config_path}: {exc}") from None
    flags = dict(flags)
    if flags.get("topology"):  # a flag's path is the shell's, not relative to the file
        flags["topology"] = str(Path(flags["topology"]).resolve())
    api = _api(table, flags)
    allow_open = _knob(table, flags, _ALLOW_UNAUTHENTICATED)
    cfg, serve = _load_table(table, flags, Path(config_path).parent if config_path else Path("."))
    if serve["http_port"]:  # (0: no HTTP port; the unix socket is guarded by its file mode)
        check_open_http(
            str(serve["host"]),
            guarded=bool(api.api_keys_file or api.http_mtls),
            allowed=allow_open,
            who="router HTTP API",
            remedy="[api] api_keys_file (--api-keys-file) or http_mtls (--http-mtls)",
        )
    return cfg, serve, api


def _knob(table: dict[str, Any], flags: dict[str, Any], name: str) -> bool:
    """A true/false setting of the file, a flag overriding it; taken out of both."""
    value = table.pop(name, False)
    flag = flags.pop(name, None)
    value = value if flag is None else flag
    if not isinstance(value, bool):
        raise ConfigError(f"router config: {name} must be true or false")
    return value


def _vllm(section: Any) -> Any:
    """The ``[vllm]`` table (``router.config.VllmEngineConfig``): unknown keys and wrong types refused."""
    from router.config import VllmEngineConfig

    if not isinstance(section, dict):
        raise ConfigError("router config: [vllm] must be a table")
    fields = VllmEngineConfig.__dataclass_fields__
    unknown = set(section) - set(fields)
    if unknown:
        raise ConfigError(f"router config [vllm]: unknown key(s) {', '.join(sorted(unknown))}")
    kinds: dict[str, Any] = {"str": str, "float": (int, float), "bool": bool}
    for key, value in section.items():
        want = str(fields[key].type)
        if not isinstance(value, kinds[want]) or (want != "bool" and isinstance(value, bool)):
            raise ConfigError(f"router config [vllm]: {key} must be {want}, got {value!r}")
    kwargs: dict[str, Any] = {
        k: float(v) if str(fields[k].type) == "float" else v for k, v in section.items()
    }
    return VllmEngineConfig(**kwargs)


def _membership(section: Any) -> Any:
    """The ``[membership]`` table (``pddlink.membership.config.MembershipConfig``)."""
    from pddlink.membership.config import MembershipConfig

    if not isinstance(section, dict):
        raise ConfigError("router config: [membership] must be a table")
    fields = MembershipConfig.__dataclass_fields__
    unknown = set(section) - set(fields) | ({"datacenter", "ttl_s"} & set(section))
    if unknown:
        raise ConfigError(f"router config [membership]: unknown key(s) {', '.join(sorted(unknown))}")
    kinds: dict[str, Any] = {"str": str, "float": (int, float)}
    for key, value in section.items():
        want = str(fields[key].type)
        if not isinstance(value, kinds[want]) or isinstance(value, bool):
            raise ConfigError(f"router config [membership]: {key} must be {want}, got {value!r}")
    floats = {k for k in section if str(fields[k].type) == "float"}
    kwargs: dict[str, Any] = {k: float(v) if k in floats else v for k, v in section.items()}
    return MembershipConfig(**kwargs)


def _load(config_path: str | None, flags: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    cfg, serve, _ = load_router_config(config_path, flags)
    return cfg, serve


def _topology(value: Any, base: Path) -> Any:
    """``[topology]`` (a table) or ``topology = "path.toml"`` (relative to the router's file)."""
    from pddlink.topology import load_topology, topology_from_table

    if isinstance(value, str):
        path = Path(value)
        return load_topology(path if path.is_absolute() else base / path)
    return topology_from_table(value)


def _load_table(
    table: dict[str, Any], flags: dict[str, Any], base: Path = Path(".")
) -> tuple[Any, dict[str, Any]]:
    from router import RouterConfig

    table.update({k: v for k, v in flags.items() if v is not None})
    if table.pop("no_relay", False):
        table["relay_enabled"] = False
    allow_plaintext = table.pop(_ALLOW_PLAINTEXT, False)
    if not isinstance(allow_plaintext, bool):
        raise ConfigError(f"router config: {_ALLOW_PLAINTEXT} must be true or false")
    serve = {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0, "unix": ""}
    for key in _SERVE:
        if key in table:
            serve[key] = table.pop(key)
    if "vllm" in table:
        table["vllm"] = _vllm(table["vllm"])
    if "topology" in table:
        table["topology"] = _topology(table["topology"], base)
    if "membership" in table:
        table["membership"] = _membership(table["membership"])
    known = set(RouterConfig.__dataclass_fields__)
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"router config: unknown key(s) {', '.join(sorted(unknown))}")
    missing = {r.value for r in SIDECAR_ROLES} - set(table)
    if missing and table.get("engine", "reference") == "reference" and "topology" not in table:
        raise ConfigError(
            f"router config: {', '.join(sorted(missing))} required (--p/--rld/--md or the file)"
        )
    check_plaintext_exposure(
        str(serve["host"]), tls=bool(table.get("tls_dir")), allowed=allow_plaintext, who="router"
    )
    try:
        return RouterConfig(**table), serve
    except TypeError as exc:
        raise ConfigError(f"router config: {exc}") from None


def _preflight(cfg: Any, serve: dict[str, Any]) -> None:
    """Listeners can bind, sockets can be made, TLS credentials are there; sockets owner-only."""
    from pddlink.cli.preflight import check_listen, check_unix_socket, private_umask

    check_listen(serve["host"], serve["grpc_port"], "router gRPC port")
    if serve["http_port"]:
        check_listen(serve["host"], serve["http_port"], "router HTTP port")
    if serve["unix"]:
        check_unix_socket(serve["unix"], "router socket")
        check_unix_socket(serve["unix"] + ".grpc", "router gRPC socket")
    cfg.load_tls()  # reads the node directory now: a missing or unsafe one is one line, not a traceback
    private_umask()


@click.command(name="router")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML file (flags override).")
@click.option("--p", "p", help="P sidecar gRPC address host:port.")
@click.option("--rld", "rld", help="RLD sidecar gRPC address host:port.")
@click.option("--md", "md", help="MD sidecar gRPC address host:port (across the WAN).")
@click.option(
    "--topology",
    type=click.Path(dir_okay=False),
    help="TOML file with a [topology]: pools instead of --p/--rld/--md.",
)
@click.option(
    "--placement",
    type=click.Choice(["prefix_aware", "round_robin", "least_loaded", "prefix_hash"]),
    help="Which MD (and P, RLD) serves a request [prefix_aware].",
)
@click.option("--host", help="Address to bind [127.0.0.1].")
@click.option("--grpc-port", type=int, help="gRPC port (0: any free port).")
@click.option("--http-port", type=int, help="HTTP port for /v1/completions (0: off).")
@click.option("--unix", help="Also serve HTTP on this unix socket (and gRPC on <path>.grpc).")
@click.option(
    "--no-relay", is_flag=True, default=None, help="Cross-datacenter PD baseline: every request P->MD."
)
@click.option("--relay-min-wan-s", type=float, help="Relay when the WAN estimate is longer [0.15].")
@click.option(
    "--recompute/--no-recompute", default=None, help="MD may prefill the missing suffix itself [on]."
)
@click.option(
    "--admission/--no-admission",
    default=None,
    help="Reject at once (503 / RESOURCE_EXHAUSTED) what no option ends before its deadline [on].",
)
@click.option("--md-prefill-tokens-per-s", type=float, help="MD's prefill speed to start from [3300].")
@click.option("--p-prefill-tokens-per-s", type=float, help="P's prefill speed to start from [3300].")
@click.option("--md-tpot-s", type=float, help="MD's time per output token, for deadlines [0.02].")
@click.option(
    "--slo-ttft-ms",
    type=click.FloatRange(min=0),
    help="TTFT SLO: options that miss it are not taken, a request none meets is refused [0: none].",
)
@click.option(
    "--slo-tpot-ms",
    type=click.FloatRange(min=0),
    help="TPOT SLO: recompute on MD only within it for MD's running requests and this one [0: none].",
)
@click.option("--rld-capacity", type=int, help="Requests at which RLD's load is 1.0 [8].")
@click.option(
    "--rld-token-budget",
    type=click.FloatRange(min=0, max=1, min_open=True),
    help="No new relay while RLD made this share of the recent output tokens [1: no budget].",
)
@click.option("--rld-tpot-s", type=float, help="RLD's time per output token, for the singular test [0.02].")
@click.option("--singular-max-tokens", type=int, help="Only outputs this short may end on RLD [4].")
@click.option("--line-mbit", type=float, help="WAN line rate for the link model [100].")
@click.option("--rtt-ms", type=float, help="WAN round-trip time for the link model [30].")
@click.option("--deadline-s", type=float, help="Default request deadline [30].")
@click.option("--kv-bytes-per-token", type=int, help="KV bytes per token of the model [2048].")
@click.option("--vocab-size", type=int, help="Model vocabulary, for prompt validation [2048].")
@click.option(
    "--tls-dir", help="Dev PKI directory: mutual TLS 1.3 to the sidecars and on --grpc-port ('' = plaintext)."
)
@click.option("--model", help="Model name the OpenAI API serves (/v1/models) [pddlink].")
@click.option("--tokenizer", help="Model directory with tokenizer.json (+ chat template): text in and out.")
@click.option("--api-keys-file", help="Bearer API keys, one per line: clients must send one.")
@click.option(
    "--http-mtls/--no-http-mtls", default=None, help="HTTP port takes TLS with client certificates (tls_dir)."
)
@click.option(
    "--allow-plaintext-non-loopback",
    is_flag=True,
    default=None,
    help="Accept --tls-dir '' on a non-loopback --host (refused otherwise).",
)
@click.option(
    "--allow-unauthenticated-non-loopback",
    is_flag=True,
    default=None,
    help="Accept --http-port without API keys or --http-mtls on a non-loopback --host (refused otherwise).",
)
def command(config_path: str | None, **flags: Any) -> None:
    """Run the router. Prints `READY {json}` once it serves; stops on SIGTERM or Ctrl-C."""
    from pddlink import eventloop
    from router.api import serve_router

    cfg, serve, api = load_router_config(config_path, flags)
    _preflight(cfg, serve)
    eventloop.run(serve_router(cfg, **serve, api=api))
