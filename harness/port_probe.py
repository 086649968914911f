"""Does every port of a deployment refuse a client without credentials, and serve one with them?

A ``Target`` is one listening port and how it is guarded:

- ``tls``: mutual TLS 1.3 (gRPC, the KV data plane). A plaintext client gets no answer (no bytes,
  or only a TLS alert); a TLS client without a certificate is cut off at its first read (TLS 1.3
  servers check the client's certificate after the client's handshake ends, then send
  ``certificate_required`` and close); a client with a certificate of the deployment's CA is served:
  the connection stays open for it (the KV port waits for its hello) or answers (HTTP/2 SETTINGS).
- ``http``: bearer keys (the router's API, a sidecar's admin port). Each of ``paths`` answers 401
  without a key, except ``open_paths`` (liveness and readiness probes, which carry no credentials);
  with the key nothing answers 401.

``probe`` returns what happened as plain data; ``refusals`` says which ports let an anonymous
client through and which turned a credentialed one away (empty: the deployment holds). Runs
where the client is: ``python -m harness.port_probe SPEC.json`` prints the results as JSON (the
compose lab runs it in a probe container; SPEC names the targets, the client's certificate and
the keys).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TLS_ALERT = 0x15  # a TLS record of type alert: a refusal, not an answer
PLAINTEXT_HELLO = b"GET /status HTTP/1.1\r\nhost: x\r\n\r\nPRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # what listens there ("md grpc")
    host: str
    port: int
    kind: str  # "tls" | "http"
    paths: tuple[str, ...] = ()  # http: "GET /status", "POST /drc/match"
    open_paths: tuple[str, ...] = ()  # http: answer without a key (probes)
    key: str = ""  # http: the bearer key that must get through


@dataclass(frozen=True, slots=True)
class Client:
    """The credentialed client: a certificate of the deployment's CA (any identity)."""

    cert_file: str
    key_file: str
    ca_file: str


@dataclass(frozen=True, slots=True)
class Outcome:
    served: bool
    detail: str


@dataclass(frozen=True, slots=True)
class PortResult:
    target: Target
    anonymous: dict[str, Outcome] = field(default_factory=dict)  # how -> outcome
    credentialed: dict[str, Outcome] = field(default_factory=dict)


def plaintext(host: str, port: int, timeout_s: float) -> Outcome:
    """Send an HTTP/1 request and an HTTP/2 preface in the clear: does anything answer?"""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(PLAINTEXT_HELLO)
            data = s.recv(4096)
    except TimeoutError:
        return Outcome(False, "no answer")
    except OSError as exc:
        return Outcome(False, f"closed: {exc}")
    if not data:
        return Outcome(False, "closed without an answer")
    if data[0] == TLS_ALERT:
        return Outcome(False, "a TLS alert")
    return Outcome(True, f"answered {data[:40]!r}")


def tls(host: str, port: int, client: Client | None, timeout_s: float) -> Outcome:
    """A TLS 1.3 handshake with (or without) ``client``'s certificate, then one read: served when
    the connection answers or stays open for ``timeout_s``, refused when it fails or closes."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # pddlink identities are SAN URIs, not host names
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["h2"])  # gRPC's servers require it; the KV server ignores it
    if client is None:
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cafile=client.ca_file)
        ctx.load_cert_chain(client.cert_file, client.key_file)
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            ctx.wrap_socket(raw, do_handshake_on_connect=False) as s,
        ):
            try:
                s.do_handshake()
            except TimeoutError:
                return Outcome(False, "no TLS handshake")
            try:
                data = s.recv(4096)
            except TimeoutError:
                return Outcome(True, "handshake done, connection held open")
    except ssl.SSLError as exc:
        return Outcome(False, f"TLS: {exc.reason or exc}")
    except OSError as exc:
        return Outcome(False, f"closed: {exc}")
    if not data:
        return Outcome(False, "closed after the handshake")
    return Outcome(True, f"answered {len(data)} bytes")


def http_status(host: str, port: int, request: str, key: str, timeout_s: float) -> Outcome:
    """``request`` ("GET /status") with ``key`` as a bearer key (or none): served unless 401."""
    method, _, path = request.partition(" ")
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        body = b'{"tokens": [1, 2, 3]}' if method == "POST" else None
        conn.request(method, path, body=body, headers=headers)
        status = conn.getresponse().status
    except OSError as exc:
        return Outcome(False, f"no HTTP answer: {exc}")
    finally:
        conn.close()
    return Outcome(status != 401, f"HTTP {status}")


def probe(target: Target, client: Client, timeout_s: float = 2.0) -> PortResult:
    h, p = target.host, target.port
    if target.kind == "tls":
        anonymous = {"plaintext": plaintext(h, p, timeout_s), "tls_without_cert": tls(h, p, None, timeout_s)}
        return PortResult(target, anonymous, {"tls_with_cert": tls(h, p, client, timeout_s)})
    requests = (*target.paths, *target.open_paths)
    return PortResult(
        target,
        anonymous={r: http_status(h, p, r, "", timeout_s) for r in requests},
        credentialed={r: http_status(h, p, r, target.key, timeout_s) for r in target.paths},
    )


def refusals(results: list[PortResult]) -> list[str]:
    """What does not hold: an anonymous client served (other than on an open path), a
    credentialed one refused, an open path that does not answer. Empty: every port holds."""
    wrong = []
    for r in results:
        t = r.target
        at = f"{t.name} {t.host}:{t.port}"
        for how, out in r.anonymous.items():
            if how in t.open_paths and out.detail != "HTTP 200":
                wrong.append(f"{at} {how}: a probe path must answer 200 without a key, {out.detail}")
            elif how not in t.open_paths and out.served:
                wrong.append(f"{at} served a client without credentials ({how}: {out.detail})")
        wrong += [
            f"{at} refused a client with credentials ({how}: {out.detail})"
            for how, out in r.credentialed.items()
            if not out.served
        ]
    return wrong


def to_json(results: list[PortResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]


def from_json(doc: list[dict[str, Any]]) -> list[PortResult]:
    out = []
    for r in doc:
        t = r["target"]
        target = Target(**{**t, "paths": tuple(t["paths"]), "open_paths": tuple(t["open_paths"])})
        out.append(
            PortResult(
                target,
                {k: Outcome(**v) for k, v in r["anonymous"].items()},
                {k: Outcome(**v) for k, v in r["credentialed"].items()},
            )
        )
    return out


ADMIN_PATHS = (
    "GET /status",
    "GET /metrics",
    "GET /memory",
    "GET /drc/stats",
    "GET /drc/snapshot",
    "POST /drc/match",
)
ADMIN_OPEN = ("GET /healthz", "GET /readyz")  # pddlink.serving.admin_access.OPEN_PATHS: the k8s probes
ROUTER_PATHS = ("GET /v1/models", "POST /v1/completions", "GET /status", "GET /memory", "GET /metrics")
ROUTER_OPEN = ("GET /healthz",)


def deployment_targets(
    config_dir: Path,
    host_of: Callable[[str], str],
    keys: dict[str, str],
    port_of: Callable[[int], int] = lambda port: port,
) -> list[Target]:
    """Every TCP port the roles' configs in ``config_dir`` (p, rld, md, router ``.toml``) listen on,
    at ``host_of(role)`` and ``port_of(port)``; ``keys[role]``: the bearer key of its HTTP port."""
    from pddlink.cli.router import load_router_config
    from sidecar.config import load_config

    out = []
    for role in ("p", "rld", "md"):
        cfg = load_config(config_dir / f"{role}.toml")
        host = host_of(role)
        out.append(Target(f"{role} grpc", host, port_of(cfg.grpc_port), "tls"))
        if cfg.kv_port:
            out.append(Target(f"{role} kv", host, port_of(cfg.kv_port), "tls"))
        if cfg.admin_port:
            port = port_of(cfg.admin_port)
            out.append(Target(f"{role} admin", host, port, "http", ADMIN_PATHS, ADMIN_OPEN, keys[role]))
    _, serve, _ = load_router_config(str(config_dir / "router.toml"), {})
    host = host_of("router")
    out.append(Target("router grpc", host, port_of(serve["grpc_port"]), "tls"))
    if serve["http_port"]:
        port = port_of(serve["http_port"])
        out.append(Target("router http", host, port, "http", ROUTER_PATHS, ROUTER_OPEN, keys["router"]))
    return out


def spec_json(targets: list[Target], client: Client) -> str:
    """What ``main`` reads."""
    return json.dumps({"client": asdict(client), "targets": [asdict(t) for t in targets]})


def main(argv: list[str]) -> int:
    """``SPEC.json``: {"client": {cert_file, key_file, ca_file}, "targets": [Target fields...]}."""
    spec = json.loads(Path(argv[0]).read_text())
    client = Client(**spec["client"])
    targets = [
        Target(**{**t, "paths": tuple(t.get("paths", ())), "open_paths": tuple(t.get("open_paths", ()))})
        for t in spec["targets"]
    ]
    sys.stdout.write(json.dumps(to_json([probe(t, client) for t in targets])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
