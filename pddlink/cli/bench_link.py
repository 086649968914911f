"""``pddlink bench link``: goodput of a transport between two OS processes.

The command you run is the coordinator. It starts the receiver and the sender as separate
processes (the same command with the hidden ``--role``), over loopback by default or inside the
two datacenters of a netlab WAN (``--netlab PROFILE``: receiver in dc-b, sender in dc-a; the lab
is brought up for the run and torn down after). Peers talk to the coordinator with one JSON line
each on stdout; logs and progress go to stderr. With ``--json`` the coordinator prints exactly one
JSON object: transport, streams, bytes, seconds, goodput_gbit_per_s, cpu_s_per_gb (sender plus
receiver CPU over the transfer), retransmits (TCP_INFO total_retrans of the sender's sockets).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from pddlink.bench import peer
from pddlink.bench.peer import BenchSpec
from pddlink.bench.run import run_loopback, run_netlab


@click.command(name="link")
@click.option("--transport", type=click.Choice(["tcp", "quic"]), default="tcp", show_default=True)
@click.option("--streams", type=click.IntRange(1, 64), default=None, help="TCP stripes [tcp: 4, quic: 1]")
@click.option("--bytes", "total_bytes", type=click.IntRange(1), default=1_000_000_000, show_default=True)
@click.option("--chunk-bytes", type=click.IntRange(4096), default=4 << 20, show_default=True)
@click.option(
    "--transfer-bytes",
    type=click.IntRange(4096),
    default=32 << 20,
    show_default=True,
    help="size of one transfer (default: the KV delta of a typical request, a 64K-token prompt at a 90% "
    "prefix hit, ~29 MB); --bytes is sent as several transfers, each from its own source region",
)
@click.option("--codec", type=click.Choice(["none", "kv"]), default="none", show_default=True)
@click.option("--cc", type=click.Choice(["bbr", "cubic", "reno"]), default="bbr", show_default=True)
@click.option("--tls/--no-tls", default=False, show_default=True, help="TLS 1.3 mutual auth (QUIC always)")
@click.option("--quic-impl", type=click.Choice(["auto", "qh3", "aioquic"]), default="auto", show_default=True)
@click.option(
    "--loop",
    "event_loop",
    type=click.Choice(["auto", "uvloop", "asyncio"]),
    default="auto",
    show_default=True,
    help="event loop of both peers (auto: uvloop for tcp, asyncio for quic)",
)
@click.option("--netlab", "netlab_profile", default=None, help="netlab profile (name or TOML file)")
@click.option(
    "--line-mbit",
    type=click.FloatRange(0),
    default=None,
    help="the line's rate, as an operator configures it for a leased line: TCP stripes pace to share "
    "it (0: unpaced) [default: with --netlab, the profile's A->B rate; else 0]",
)
@click.option("--deadline-s", type=click.FloatRange(0.1), default=300.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
@click.option("--role", type=click.Choice(["receiver", "sender"]), default=None, hidden=True)
@click.option("--peer", "peer_addr", default=None, hidden=True)
@click.option("--listen", "listen_addr", default=None, hidden=True)
@click.option("--certs", type=click.Path(path_type=Path), default=None, hidden=True)
@click.option("--datagram-bytes", type=click.IntRange(1200, 65527), default=8952, hidden=True)
def command(
    transport: str,
    streams: int | None,
    total_bytes: int,
    chunk_bytes: int,
    transfer_bytes: int,
    codec: str,
    cc: str,
    tls: bool,
    quic_impl: str,
    event_loop: str,
    netlab_profile: str | None,
    line_mbit: float | None,
    deadline_s: float,
    as_json: bool,
    role: str | None,
    peer_addr: str | None,
    listen_addr: str | None,
    certs: Path | None,
    datagram_bytes: int,
) -> None:
    """Goodput of a transport between two processes (loopback or across netlab)."""
    spec = BenchSpec(
        transport=transport,
        streams=streams if streams is not None else (4 if transport == "tcp" else 1),
        total_bytes=total_bytes,
        chunk_bytes=chunk_bytes,
        transfer_bytes=min(transfer_bytes, total_bytes),
        codec=codec,
        congestion_control=cc,
        tls=tls or transport == "quic",
        quic_impl=quic_impl,
        deadline_s=deadline_s,
        certs=certs,
        max_datagram_bytes=datagram_bytes,
        event_loop=event_loop,
        line_rate_bps=_line_mbit(line_mbit, netlab_profile) * 1e6,
    )
    if role == "receiver":
        peer.run_role(peer.receive, spec, listen_addr or "127.0.0.1:0")
        return
    if role == "sender":
        if not peer_addr:
            raise click.UsageError("--role sender needs --peer host:port")
        peer.run_role(peer.send, spec, peer_addr)
        return
    result = run_netlab(spec, netlab_profile) if netlab_profile else run_loopback(spec)
    _print(result, as_json)


def _line_mbit(given: float | None, netlab_profile: str | None) -> float:
    """The line rate the stripes pace to: as given, else the netlab profile's A->B rate (the rate
    the sender's side of that line has, as an operator would configure it), else 0 (unpaced)."""
    if given is not None:
        return given
    if netlab_profile is None:
        return 0.0
    from netlab.profile import load_profile

    return float(load_profile(netlab_profile).a_to_b.rate_mbit)


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result))
        return
    rt = result.get("retransmits")
    click.echo(
        f"{result['transport']} x{result['streams']}: {result['bytes'] / 1e9:.2f} GB in "
        f"{result['seconds']:.2f} s = {result['goodput_gbit_per_s']:.2f} Gbit/s, "
        f"{result['cpu_s_per_gb']:.2f} CPU s/GB, retransmits {rt if rt is not None else 'n/a'}"
    )
    sys.stdout.flush()
