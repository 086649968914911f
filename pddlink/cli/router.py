"""``pddlink router``: the client API, pipeline policy and stream merging in front of P, RLD, MD."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import click

from pddlink.errors import ConfigError
from pddlink.roles import SIDECAR_ROLES

# flag -> (RouterConfig field or serving option, type)
_SERVE = {"host": str, "grpc_port": int, "http_port": int, "unix": str}


def _load(config_path: str | None, flags: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from router import RouterConfig

    table: dict[str, Any] = {}
    if config_path:
        try:
            table = tomllib.loads(Path(config_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"router config {config_path}: {exc}") from None
    table.update({k: v for k, v in flags.items() if v is not None})
    if table.pop("no_relay", False):
        table["relay_enabled"] = False
    serve = {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0, "unix": ""}
    for key in _SERVE:
        if key in table:
            serve[key] = table.pop(key)
    known = set(RouterConfig.__dataclass_fields__)
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"router config: unknown key(s) {', '.join(sorted(unknown))}")
    missing = {r.value for r in SIDECAR_ROLES} - set(table)
    if missing:
        raise ConfigError(
            f"router config: {', '.join(sorted(missing))} required (--p/--rld/--md or the file)"
        )
    try:
        return RouterConfig(**table), serve
    except TypeError as exc:
        raise ConfigError(f"router config: {exc}") from None


@click.command(name="router")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML file (flags override).")
@click.option("--p", "p", help="P sidecar gRPC address host:port.")
@click.option("--rld", "rld", help="RLD sidecar gRPC address host:port.")
@click.option("--md", "md", help="MD sidecar gRPC address host:port (across the WAN).")
@click.option("--host", help="Address to bind [127.0.0.1].")
@click.option("--grpc-port", type=int, help="gRPC port (0: any free port).")
@click.option("--http-port", type=int, help="HTTP port for /v1/completions (0: off).")
@click.option("--unix", help="Also serve HTTP on this unix socket (and gRPC on <path>.grpc).")
@click.option(
    "--no-relay", is_flag=True, default=None, help="Cross-datacenter PD baseline: every request P->MD."
)
@click.option("--relay-min-wan-s", type=float, help="Relay when the WAN estimate is longer [0.15].")
@click.option("--rld-capacity", type=int, help="Requests at which RLD's load is 1.0 [8].")
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
def command(config_path: str | None, **flags: Any) -> None:
    """Run the router. Prints `READY {json}` once it serves; stops on SIGTERM or Ctrl-C."""
    from pddlink import eventloop
    from router.api import serve_router

    cfg, serve = _load(config_path, flags)
    eventloop.run(serve_router(cfg, **serve))
