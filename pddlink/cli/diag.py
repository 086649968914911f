"""``pddlink ping`` and ``pddlink status``: diagnostics against running sidecars and routers."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click


def _ping(peer: str, count: int, bandwidth_bytes: int, timeout_s: float) -> dict[str, Any]:
    import grpc

    from pddlink.errors import Unavailable
    from sidecar.rpc import stubs

    pb2, pb2_grpc = stubs()
    opts = [("grpc.max_receive_message_length", 128 << 20)]
    with grpc.insecure_channel(peer, options=opts) as channel:
        stub = pb2_grpc.SidecarStub(channel)
        rtts = []
        reply = None
        try:
            for nonce in range(count):
                t0 = time.perf_counter()
                reply = stub.Ping(pb2.PingRequest(nonce=nonce), timeout=timeout_s)
                rtts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            big = stub.Ping(
                pb2.PingRequest(nonce=count, payload_bytes=bandwidth_bytes), timeout=timeout_s * 10
            )
            seconds = time.perf_counter() - t0
        except grpc.RpcError as exc:
            raise Unavailable(f"{peer}: {exc.code().name}: {exc.details()}") from None
    assert reply is not None
    rtt = sorted(rtts)
    transfer_s = max(seconds - rtt[len(rtt) // 2], 1e-6)
    return {
        "peer": peer,
        "role": reply.role,
        "peer_id": reply.peer_id,
        "model_id": reply.model_id,
        "wire_version": reply.wire_version,
        "hash_scheme": reply.hash_scheme,
        "tls_identity": reply.tls_identity or None,
        "rtt_ms": {"min": rtt[0] * 1e3, "median": rtt[len(rtt) // 2] * 1e3, "max": rtt[-1] * 1e3},
        "bandwidth_mbit_per_s": len(big.payload) * 8 / transfer_s / 1e6,
        "bandwidth_probe_bytes": len(big.payload),
    }


@click.command(name="ping")
@click.argument("peer")
@click.option("--count", default=5, show_default=True, help="Round trips to time.")
@click.option(
    "--bandwidth-bytes", default=4 << 20, show_default=True, help="Reply size for the bandwidth probe."
)
@click.option("--timeout-s", default=5.0, show_default=True, help="Per-ping timeout.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def ping(peer: str, count: int, bandwidth_bytes: int, timeout_s: float, as_json: bool) -> None:
    """Ping a running sidecar's gRPC address (host:port): RTT, a bandwidth estimate, its wire version,
    hash scheme, role, model and TLS identity (the data plane's certificate identity)."""
    if count < 1:
        raise click.BadParameter("must be >= 1", param_hint="--count")
    out = _ping(peer, count, bandwidth_bytes, timeout_s)
    if as_json:
        click.echo(json.dumps(out))
        return
    r = out["rtt_ms"]
    click.echo(
        f"{peer}: {out['role']} {out['peer_id']} model {out['model_id']} wire v{out['wire_version']} "
        f"hash scheme {out['hash_scheme']} TLS identity {out['tls_identity'] or '(plaintext)'}\n"
        f"rtt min/median/max {r['min']:.2f}/{r['median']:.2f}/{r['max']:.2f} ms, "
        f"bandwidth ~{out['bandwidth_mbit_per_s']:.0f} Mbit/s ({out['bandwidth_probe_bytes']} B probe)"
    )


@click.command(name="status")
@click.argument("targets", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {target: status}.")
def status(targets: tuple[str, ...], as_json: bool) -> None:
    """Pipelines in flight, transfers, DRC and link estimates of running sidecars and routers.

    TARGETS are their admin HTTP addresses: host:port or unix:/path (sidecar --admin-port /
    --admin-unix, router --http-port / --unix)."""
    from sidecar.http import fetch

    out: dict[str, Any] = {}
    for target in targets:
        try:
            code, body = fetch(target, "GET", "/status", timeout_s=5.0)
            out[target] = json.loads(body) if code == 200 else {"error": f"HTTP {code}"}
        except OSError as exc:
            out[target] = {"error": f"unreachable: {exc}"}
    if as_json:
        click.echo(json.dumps(out))
        return
    for target, doc in out.items():
        click.echo(f"== {target}")
        for key, value in doc.items():
            click.echo(f"  {key}: {json.dumps(value) if isinstance(value, dict | list) else value}")
    if any("error" in d for d in out.values()):
        sys.exit(1)
