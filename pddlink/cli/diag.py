"""``pddlink ping`` and ``pddlink status``: diagnostics against running sidecars and routers."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click


def _tls_probe(peer: str, tls_dir: str, identity: str, expect: str, timeout_s: float) -> tuple[Any, Any]:
    """(our credentials, what the server's TLS handshake showed); (None, None) for plaintext."""
    from pddlink.serving.grpc_tls import probe_server
    from pddlink.transport import PeerIdentity, load_node
    from pddlink.transport.tls import check_peer

    if not tls_dir:
        return None, None
    tls = load_node(Path(tls_dir), PeerIdentity.parse(identity))  # never mints: `pddlink pki issue`
    seen = probe_server(peer, tls, timeout_s)
    check_peer(seen.identity, expected=PeerIdentity.parse(expect) if expect else None)
    return tls, seen


def _ping(
    peer: str, count: int, bandwidth_bytes: int, timeout_s: float, tls: Any = None, seen: Any = None
) -> dict[str, Any]:
    import grpc

    from pddlink.errors import Unavailable
    from pddlink.serving.grpc_tls import open_sync_channel
    from pddlink.serving.rpc import stubs

    pb2, pb2_grpc = stubs()
    opts = [("grpc.max_receive_message_length", 128 << 20)]
    expected = seen.identity if seen is not None else None
    with open_sync_channel(peer, tls, expected, opts) as channel:
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
            hint = "" if tls is not None else " (plaintext ping: if the peer runs TLS, pass --tls-dir)"
            raise Unavailable(f"{peer}: {exc.code().name}: {exc.details()}{hint}") from None
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
        # the identity this side saw in the TLS handshake (and gRPC checked again); None: plaintext
        "tls_identity": seen.identity.uri if seen is not None else None,
        "tls_version": seen.version if seen is not None else None,
        "tls_cipher": seen.cipher if seen is not None else None,
        "reported_identity": reply.tls_identity or None,  # what the sidecar says its certificate is
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
@click.option(
    "--tls-dir",
    default="",
    envvar="PDDLINK_TLS_DIR",
    help="This client's PKI directory (pddlink pki issue ... diag/ping): mutual TLS 1.3. Empty: plaintext.",
)
@click.option("--identity", default="diag/ping", show_default=True, help="This client's identity role/name.")
@click.option("--expect", default="", help="Refuse unless the peer's certificate names this role/name.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def ping(
    peer: str,
    count: int,
    bandwidth_bytes: int,
    timeout_s: float,
    tls_dir: str,
    identity: str,
    expect: str,
    as_json: bool,
) -> None:
    """Ping a running sidecar's gRPC address (host:port): RTT, a bandwidth estimate, its wire version,
    hash scheme, role, model and the TLS identity its certificate showed in the handshake."""
    if count < 1:
        raise click.BadParameter("must be >= 1", param_hint="--count")
    tls, seen = _tls_probe(peer, tls_dir, identity, expect, timeout_s)
    out = _ping(peer, count, bandwidth_bytes, timeout_s, tls, seen)
    if as_json:
        click.echo(json.dumps(out))
        return
    r = out["rtt_ms"]
    click.echo(
        f"{peer}: {out['role']} {out['peer_id']} model {out['model_id']} wire v{out['wire_version']} "
        f"hash scheme {out['hash_scheme']} TLS identity {out['tls_identity'] or '(plaintext)'}"
        f"{' (' + out['tls_version'] + ')' if out['tls_version'] else ''}\n"
        f"rtt min/median/max {r['min']:.2f}/{r['median']:.2f}/{r['max']:.2f} ms, "
        f"bandwidth ~{out['bandwidth_mbit_per_s']:.0f} Mbit/s ({out['bandwidth_probe_bytes']} B probe)"
    )


@click.command(name="status")
@click.argument("targets", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {target: status}.")
@click.option(
    "--key-file",
    envvar="PDDLINK_KEY_FILE",
    type=click.Path(dir_okay=False),
    help="Send the first key of this file as a bearer key (a sidecar's admin_keys_file, the router's "
    "api_keys_file): TCP targets need one. Unix sockets need none.",
)
def status(targets: tuple[str, ...], as_json: bool, key_file: str | None) -> None:
    """Pipelines in flight, transfers, DRC and link estimates of running sidecars and routers.

    TARGETS are their admin HTTP addresses: host:port or unix:/path (sidecar --admin-port /
    --admin-unix, router --http-port / --unix)."""
    from pddlink.serving.client_guard import load_key_file
    from pddlink.serving.http import fetch

    bearer = load_key_file(key_file, "--key-file")[0].decode() if key_file else ""
    out: dict[str, Any] = {}
    for target in targets:
        try:
            code, body = fetch(target, "GET", "/status", timeout_s=5.0, bearer=bearer)
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
