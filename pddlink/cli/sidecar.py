"""``pddlink sidecar``: run the sidecar daemon for one role beside its engine (the reference engine or
vLLM, as the file's ``engine`` key says; see ``sidecar.config`` for the file)."""

from __future__ import annotations

from typing import Any

import click

from pddlink.roles import SIDECAR_ROLES


@click.command(name="sidecar")
@click.option(
    "--role", type=click.Choice([r.value for r in SIDECAR_ROLES]), help="Role (overrides the file's)."
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML configuration file.")
@click.option("--peer-id", help="This sidecar's identity (default: <role>0).")
@click.option("--host", help="Address to bind.")
@click.option("--grpc-port", type=int, help="gRPC port (0: any free port).")
@click.option("--kv-port", type=int, help="KV transport port (RLD, MD).")
@click.option("--admin-port", type=int, help="Admin HTTP port (0: off).")
@click.option("--admin-unix", help="Also serve admin HTTP on this unix socket (no key needed there).")
@click.option(
    "--admin-keys-file", help="Bearer keys for --admin-port, one per line (all but /healthz, /readyz)."
)
@click.option("--tls-dir", help="Dev PKI directory for TLS on the data plane ('' = plaintext).")
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
    help="Accept --admin-port without --admin-keys-file on a non-loopback --host (refused otherwise).",
)
@click.option("--md-grpc", help="MD's gRPC address host:port (P, RLD).")
@click.option("--md-kv", help="MD's KV address host:port (P).")
@click.option("--rld-grpc", help="RLD's gRPC address host:port (P).")
@click.option("--rld-kv", help="RLD's KV address host:port (P).")
@click.option("--dtype", help="Engine dtype (float64 for exact token comparisons).")
@click.option("--preset", help="Reference engine preset (tiny, small, ...).")
@click.option("--num-blocks", type=int, help="Engine KV pool size in blocks.")
@click.option(
    "--prefill-slowdown",
    type=click.FloatRange(1.0, 100.0),
    help="Reference engine: prefill and extend passes take this many times as long (a decode-leaning "
    "chip, emulated; the demo's MD in wan-overload).",
)
@click.option(
    "--engine-mode",
    type=click.Choice(["thread", "process"]),
    help="thread: engine in this process; process: a child `pddlink engine` over the engine link.",
)
@click.option("--capacity", type=int, help="Decode capacity in requests (load 1.0).")
@click.option("--slice-tokens", type=int, help="Catch-up handoff slice size in tokens.")
@click.option(
    "--wan-codec",
    type=click.Choice(["auto", "raw", "planes_zstd"]),
    help="P: KV codec on the WAN leg (auto: when the line is slower than the compressor).",
)
@click.option(
    "--wan-line-mbit", type=float, help="P: the WAN line's rate for the codec decision (0: measure)."
)
@click.option(
    "--print-vllm-args",
    is_flag=True,
    help='engine = "vllm": print the vLLM server command this sidecar expects beside it, and exit.',
)
def command(config_path: str | None, print_vllm_args: bool, **flags: Any) -> None:
    """Run the sidecar daemon for one role (p, rld or md) beside its engine: the reference engine,
    or a vLLM server when the file says engine = "vllm".

    Prints one line `READY {json}` with the bound ports when every listener is up; stops on
    SIGTERM or Ctrl-C.
    """
    from sidecar.config import load_config

    keys = {
        "role": "role",
        "peer_id": "peer_id",
        "host": "host",
        "grpc_port": "grpc_port",
        "kv_port": "kv_port",
        "admin_port": "admin_port",
        "admin_unix": "admin_unix",
        "admin_keys_file": "admin_keys_file",
        "tls_dir": "tls_dir",
        "allow_plaintext_non_loopback": "allow_plaintext_non_loopback",
        "allow_unauthenticated_non_loopback": "allow_unauthenticated_non_loopback",
        "md_grpc": "peers.md_grpc",
        "md_kv": "peers.md_kv",
        "rld_grpc": "peers.rld_grpc",
        "rld_kv": "peers.rld_kv",
        "dtype": "engine.dtype",
        "preset": "engine.preset",
        "num_blocks": "engine.num_blocks",
        "prefill_slowdown": "engine.prefill_slowdown",
        "engine_mode": "engine.mode",
        "capacity": "decode.capacity",
        "slice_tokens": "decode.slice_tokens",
        "wan_codec": "data_plane.wan_codec",
        "wan_line_mbit": "data_plane.wan_line_mbit",
    }
    overrides = {keys[k]: v for k, v in flags.items() if v is not None}
    cfg = load_config(config_path, overrides)
    if print_vllm_args:
        click.echo(vllm_command_line(cfg))
        return
    preflight(cfg)
    from sidecar.daemon import run  # one program: the file's engine picks the bridge

    run(cfg)


def vllm_command_line(cfg: Any) -> str:
    """The pddlink part of the vLLM server's arguments for this sidecar's role: the connector pointed
    at this sidecar's control socket, the block size its hashes use, and (RLD, MD) the KV-event
    publisher its DRC follows. Words without spaces, so that ``python -m
    vllm.entrypoints.openai.api_server --model M --port N $(pddlink sidecar --config F
    --print-vllm-args)`` takes them as they are."""
    from pathlib import Path

    from engines_adapter.vllm.launch import connector_args
    from pddlink.errors import ConfigError
    from pddlink.roles import Role

    if cfg.engine_kind != "vllm":
        raise ConfigError('--print-vllm-args needs a configuration with engine = "vllm"')
    sock = Path(cfg.vllm.workdir).absolute() / f"{cfg.name}.sock"
    args = connector_args(
        Role(cfg.role), sock, kv_events_endpoint=cfg.vllm.kv_events_endpoint, block_size=cfg.vllm.block_size
    )
    if cfg.vllm.max_model_len:
        args += ["--max-model-len", str(cfg.vllm.max_model_len)]
    if any(not a or any(c.isspace() for c in a) for a in args):
        raise ConfigError(f"vllm.workdir {cfg.vllm.workdir!r}: the printed arguments must have no spaces")
    return " ".join(args)


def preflight(cfg: Any) -> None:
    """Before the engine loads: every listener can bind, the admin socket can be made, the TLS
    credentials and admin keys are there; and what this process creates from now on is its owner's
    only."""
    from pathlib import Path

    from pddlink.cli.preflight import check_listen, check_unix_socket, private_umask
    from pddlink.serving.client_guard import load_key_file
    from pddlink.transport import PeerIdentity, load_node

    ports = [] if cfg.engine_kind == "vllm" else [("gRPC", cfg.grpc_port)]  # vLLM's: no engine gRPC
    if cfg.role in ("rld", "md"):
        ports.append(("KV", cfg.kv_port))
    if cfg.admin_port:
        ports.append(("admin", cfg.admin_port))
    for what, port in ports:
        check_listen(cfg.host, port, f"sidecar {what} port")
    check_unix_socket(cfg.admin_unix, "sidecar admin socket")
    if cfg.tls_dir:
        load_node(Path(cfg.tls_dir), PeerIdentity(cfg.role, cfg.name))
    if cfg.admin_keys_file:
        load_key_file(cfg.admin_keys_file, "admin_keys_file")
    private_umask()
