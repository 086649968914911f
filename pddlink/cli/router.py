"""``pddlink router``: the client API, pipeline policy and stream merging in front of P, RLD, MD."""

from __future__ import annotations

import click


@click.command(name="router")
@click.option("--p", "p_addr", required=True, help="P sidecar gRPC address host:port.")
@click.option("--rld", "rld_addr", required=True, help="RLD sidecar gRPC address host:port.")
@click.option("--md", "md_addr", required=True, help="MD sidecar gRPC address host:port (across the WAN).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--grpc-port", default=0, show_default=True, help="gRPC port (0: any free port).")
@click.option("--http-port", default=0, show_default=True, help="HTTP port for /v1/completions (0: off).")
@click.option("--unix", default="", help="Also serve HTTP on this unix socket (and gRPC on <path>.grpc).")
@click.option("--no-relay", is_flag=True, help="Cross-datacenter PD baseline: every request goes P->MD.")
@click.option(
    "--relay-min-wan-s", default=0.15, show_default=True, help="Relay when the WAN estimate is longer."
)
@click.option("--rld-capacity", default=8, show_default=True, help="Requests at which RLD's load is 1.0.")
@click.option(
    "--rld-tpot-s", default=0.02, show_default=True, help="RLD's time per output token (singular test)."
)
@click.option("--line-mbit", default=100.0, show_default=True, help="WAN line rate for the link model.")
@click.option("--rtt-ms", default=30.0, show_default=True, help="WAN round-trip time for the link model.")
@click.option("--deadline-s", default=30.0, show_default=True, help="Default request deadline.")
@click.option(
    "--kv-bytes-per-token", default=2048, show_default=True, help="KV bytes per token of the model."
)
@click.option("--vocab-size", default=2048, show_default=True, help="Model vocabulary (prompt validation).")
def command(
    p_addr: str,
    rld_addr: str,
    md_addr: str,
    host: str,
    grpc_port: int,
    http_port: int,
    unix: str,
    no_relay: bool,
    relay_min_wan_s: float,
    rld_capacity: int,
    rld_tpot_s: float,
    line_mbit: float,
    rtt_ms: float,
    deadline_s: float,
    kv_bytes_per_token: int,
    vocab_size: int,
) -> None:
    """Run the router. Prints `READY {json}` once it serves; stops on SIGTERM or Ctrl-C."""
    import asyncio

    from sidecar.router import RouterConfig
    from sidecar.router_api import serve_router

    cfg = RouterConfig(
        p=p_addr,
        rld=rld_addr,
        md=md_addr,
        relay_enabled=not no_relay,
        relay_min_wan_s=relay_min_wan_s,
        rld_capacity=rld_capacity,
        rld_tpot_s=rld_tpot_s,
        line_mbit=line_mbit,
        rtt_ms=rtt_ms,
        deadline_s=deadline_s,
        kv_bytes_per_token=kv_bytes_per_token,
        vocab_size=vocab_size,
    )
    try:
        import uvloop

        uvloop.run(serve_router(cfg, host=host, grpc_port=grpc_port, http_port=http_port, unix=unix))
    except ImportError:
        asyncio.run(serve_router(cfg, host=host, grpc_port=grpc_port, http_port=http_port, unix=unix))
