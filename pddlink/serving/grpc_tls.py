"""TLS 1.3 with mutual authentication for the gRPC control plane (router <-> sidecars, P/RLD <-> MD).

The same dev PKI as the KV data plane (``pddlink.transport.tls``): one CA, one certificate per
process naming ``pddlink://<role>/<name>`` (SAN URI) and ``<role>/<name>`` (CN).

Client side (``open_channel``): the server's chain is verified against the CA, and its identity
against the peer this side meant to reach. gRPC checks names only against DNS/IP SANs, or the CN
when the certificate has neither; our certificates carry a URI SAN only, so the expected peer's
``<role>/<name>`` goes in as the target name and gRPC compares it with the CN during the
handshake. A server with another identity is refused before any RPC is sent.

Server side (``new_server``): a client certificate is required and verified against the CA in the
handshake (another CA's certificate never reaches a handler). ``CallerCheck`` then reads the
caller out of the auth context on every call: it refuses anything but TLS 1.3, parses the
identity from the verified certificate (CN and SAN must agree), refuses a role the method does not
serve, and counts calls by identity (``/status``).

``tls=None`` means plaintext: only when ``--tls-dir ''`` is given explicitly.
"""

from __future__ import annotations

import inspect
import socket
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from cryptography import x509

from pddlink.errors import Unavailable
from pddlink.transport import PeerIdentity, TlsConfig
from pddlink.transport.tls import AuthError, identity_from_certificate, identity_from_der

TLS_VERSION = "TLSv1.3"
ChannelOptions = Sequence[tuple[str, Any]]

# Sidecar service: who may call what (roles). A method not listed is open to any authenticated peer.
SIDECAR_CALLERS: Mapping[str, frozenset[str]] = {
    "/pddlink.v1.Sidecar/Prefill": frozenset({"router"}),
    "/pddlink.v1.Sidecar/Attach": frozenset({"router"}),
    "/pddlink.v1.Sidecar/StartHandoff": frozenset({"router"}),
    "/pddlink.v1.Sidecar/Release": frozenset({"router"}),
    "/pddlink.v1.Sidecar/DrcEvents": frozenset({"router"}),
    "/pddlink.v1.Sidecar/Handoff": frozenset({"router", "p", "rld"}),
}


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
        root_certificates=tls.ca_file.read_bytes(),
        require_client_auth=True,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca_file.read_bytes(),
        private_key=tls.key_file.read_bytes(),
        certificate_chain=tls.cert_file.read_bytes(),
    )


# gRPC's default reconnect backoff grows to 120 s: a role killed and restarted stayed unreachable
# for the requests of the next minutes (issue 16, chaos). A restarted role is found within ~1 s.
RECONNECT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def with_reconnect(options: ChannelOptions) -> list[tuple[str, Any]]:
    """``options`` plus ``RECONNECT_OPTIONS`` for the keys it does not set itself."""
    given = {key for key, _ in options}
    return [*options, *((k, v) for k, v in RECONNECT_OPTIONS if k not in given)]


def _target_options(expected: PeerIdentity, options: ChannelOptions) -> list[tuple[str, Any]]:
    return [*with_reconnect(options), ("grpc.ssl_target_name_override", expected.common_name)]


def open_channel(
    addr: str,
    tls: TlsConfig | None,
    expected: PeerIdentity | None,
    options: ChannelOptions = (),
    *,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to ``addr``: mutual TLS checked against ``expected``, or plaintext (tls None);
    it reconnects to a restarted peer within about a second (``RECONNECT_OPTIONS``)."""
    if tls is None:
        return grpc.aio.insecure_channel(
            addr, options=with_reconnect(options), interceptors=list(interceptors)
        )
    if expected is None:
        raise AuthError(f"a TLS channel to {addr} needs the identity it expects")
    return grpc.aio.secure_channel(
        addr,
        channel_credentials(tls),
        options=_target_options(expected, options),
        interceptors=list(interceptors),
    )


def open_sync_channel(
    addr: str, tls: TlsConfig | None, expected: PeerIdentity | None, options: ChannelOptions = ()
) -> grpc.Channel:
    """The blocking twin of ``open_channel`` (CLI diagnostics)."""
    if tls is None:
        return grpc.insecure_channel(addr, options=with_reconnect(options))
    if expected is None:
        raise AuthError(f"a TLS channel to {addr} needs the identity it expects")
    return grpc.secure_channel(addr, channel_credentials(tls), options=_target_options(expected, options))


def bind(server: grpc.aio.Server, addr: str, tls: TlsConfig | None) -> int:
    """Listen on ``addr`` (host:port or unix:path) with mutual TLS, or plaintext when tls is None."""
    if tls is None:
        return server.add_insecure_port(addr)
    return server.add_secure_port(addr, server_credentials(tls))


def new_server(
    tls: TlsConfig | None,
    *,
    callers: Mapping[str, frozenset[str]] | None = None,
    options: ChannelOptions = (),
    local_plaintext: bool = False,
) -> tuple[grpc.aio.Server, CallerCheck | None]:
    """A gRPC server; with TLS, every call passes ``CallerCheck`` first. ``local_plaintext`` admits
    calls without TLS when they come over a unix socket (a listener bound with ``tls=None``)."""
    if tls is None:
        return grpc.aio.server(options=list(options)), None
    check = CallerCheck(callers or {}, local_plaintext=local_plaintext)
    return grpc.aio.server(interceptors=[check], options=list(options)), check


def caller_identity(context: grpc.aio.ServicerContext[Any, Any]) -> PeerIdentity:
    """The caller's identity from the TLS auth context (its chain was verified in the handshake)."""
    auth = context.auth_context()
    version = b"".join(auth.get("ssl_tls_version", [])).decode("ascii", "replace")
    if version != TLS_VERSION:
        raise AuthError(f"caller negotiated {version or 'no TLS'}; {TLS_VERSION} is required")
    pem = b"".join(auth.get("x509_pem_cert", []))
    if not pem:
        raise AuthError("caller presented no certificate")
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise AuthError(f"caller certificate unreadable: {exc}") from None
    return identity_from_certificate(cert)


def _insecure(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    return context.auth_context().get("transport_security_type") == [b"insecure"]


Behaviour = Callable[[Any, Any], Any]  # (request, grpc.aio.ServicerContext) -> reply or stream
if TYPE_CHECKING:  # generic in the type stubs only
    Handler = grpc.RpcMethodHandler[Any, Any]
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


class CallerCheck(_Interceptor):
    """Admits a call only from a TLS 1.3 caller with a readable identity and an allowed role."""

    def __init__(self, callers: Mapping[str, frozenset[str]], *, local_plaintext: bool = False) -> None:
        self.callers = callers
        self.local_plaintext = local_plaintext
        self.calls: Counter[str] = Counter()  # by caller identity URI
        self.refused: Counter[str] = Counter()  # by reason

    async def _admit(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self.local_plaintext and context.peer().startswith("unix:") and _insecure(context):
            self.calls["local"] += 1  # a local client on the plaintext unix socket
            return
        try:
            who = caller_identity(context)
        except AuthError as exc:
            self.refused["unauthenticated"] += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.message)
            return
        allowed = self.callers.get(method)
        if allowed is not None and who.role not in allowed:
            self.refused["role"] += 1
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{who} (role {who.role}) may not call {method}"
            )
        self.calls[who.uri] += 1

    def _wrap_unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        async def admitted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await self._admit(method, context)
            return await behaviour(request, context)

        return admitted

    def _wrap_stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        async def admitted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await self._admit(method, context)
            result = behaviour(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:  # a handler that writes with context.write()
                await result

        return admitted

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._wrap_unary(method, handler.unary_unary), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream), **codec
            )
        # client- and bidi-streaming methods (none on the Sidecar service) are admitted per call
        # by the handshake's chain check only
        return handler

    def status(self) -> dict[str, Any]:
        return {"callers": dict(self.calls), "refused": dict(self.refused)}


@dataclass(frozen=True, slots=True)
class ServerTls:
    """What a TLS handshake with a server showed: its certified identity and the session's terms."""

    identity: PeerIdentity
    version: str
    cipher: str


def probe_server(addr: str, tls: TlsConfig, timeout_s: float) -> ServerTls:
    """A TLS 1.3 handshake with ``addr`` (host:port), chain checked against the CA: who answers?

    Used by ``pddlink ping`` to report the identity it saw before it opens the gRPC channel (which
    then checks the same identity again in its own handshake)."""
    host, _, port = addr.rpartition(":")
    ctx = tls.client_context()
    ctx.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as raw,
            ctx.wrap_socket(raw) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
            version, cipher = conn.version() or "", (conn.cipher() or ("", "", 0))[0]
    except ssl.SSLError as exc:
        raise AuthError(f"{addr}: TLS handshake refused: {exc.reason or exc}") from None
    except (OSError, ValueError) as exc:
        raise Unavailable(f"{addr}: {exc}") from None
    return ServerTls(identity_from_der(der), version, cipher)
