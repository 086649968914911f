"""TLS 1.3 with mutual authentication, and a development PKI.

Every sidecar has a certificate issued by the deployment's CA. Its identity is a
``PeerIdentity(role, name)``, written twice in the certificate: as the subject CN ``<role>/<name>``
and as a SAN URI ``pddlink://<role>/<name>``. After a handshake each side reads the identity out of
the peer's verified certificate (``identity_from_certificate``) and checks it against what the peer
claims in its hello and against what this side expects (``check_peer``); a mismatch refuses the
connection before any KV moves.

Lifecycle: a ``TlsConfig`` per endpoint (from the dev PKI, ``pddlink.transport.pki``: the CA in
its own directory, each node's directory with its key, its certificate and ``ca.pem`` only), then
``server_context()`` / ``client_context()`` for TCP (``ssl``), or the PEM paths for QUIC.
"""

from __future__ import annotations

import datetime as dt
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import NameOID

from pddlink.errors import ConfigError, ErrorCode, InvalidInput, LocalError

URI_SCHEME = "pddlink://"


class AuthError(LocalError):
    """A peer's certificate or identity was refused."""

    code = ErrorCode.AUTH


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """Who a peer is: its role (p, rld, md, router, bench, ...) and its instance name."""

    role: str
    name: str

    def __post_init__(self) -> None:
        for field, value in (("role", self.role), ("name", self.name)):
            if not value or "/" in value or not value.isprintable() or len(value) > 64:
                raise InvalidInput(f"peer identity {field} {value!r}: 1-64 printable characters, no '/'")

    @property
    def uri(self) -> str:
        return f"{URI_SCHEME}{self.role}/{self.name}"

    @property
    def common_name(self) -> str:
        return f"{self.role}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> PeerIdentity:
        """Accept ``pddlink://role/name`` or ``role/name``."""
        body = text.removeprefix(URI_SCHEME)
        role, sep, name = body.partition("/")
        if not sep:
            raise InvalidInput(f"peer identity {text!r}: expected role/name")
        return cls(role, name)

    def __str__(self) -> str:
        return self.uri


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """One endpoint's credentials and the CA it trusts. Paths are PEM files."""

    identity: PeerIdentity
    cert_file: Path
    key_file: Path
    ca_file: Path

    def __post_init__(self) -> None:
        for field in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, field)
            if not Path(path).is_file():
                raise ConfigError(f"TlsConfig.{field}: no file at {path}")

    def server_context(self) -> ssl.SSLContext:
        """TLS 1.3 only, client certificate required and verified against the CA."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._harden(ctx)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """TLS 1.3 only; the server's chain is verified, its identity by ``check_peer`` (no DNS names)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # identity is the SAN URI, checked after the handshake
        self._harden(ctx)
        return ctx

    def _harden(self, ctx: ssl.SSLContext) -> None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))

    def ca_certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(Path(self.ca_file).read_bytes())


def identity_from_certificate(cert: x509.Certificate) -> PeerIdentity:
    """The identity a certificate names; CN and SAN URI must agree."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as exc:
        raise AuthError("peer certificate has no SAN URI identity") from exc
    uris = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(URI_SCHEME)]
    if len(cns) != 1 or len(uris) != 1:
        raise AuthError("peer certificate must carry exactly one CN and one pddlink:// SAN URI")
    try:
        identity = PeerIdentity.parse(uris[0])
    except InvalidInput as exc:
        raise AuthError(f"peer certificate identity: {exc.message}") from exc
    if cns[0].value != identity.common_name:
        raise AuthError(f"peer certificate CN {cns[0].value!r} does not match SAN {identity.uri}")
    return identity


def identity_from_der(der: bytes | None) -> PeerIdentity:
    if not der:
        raise AuthError("peer presented no certificate")
    return identity_from_certificate(x509.load_der_x509_certificate(der))


def check_peer(
    certified: PeerIdentity, claimed: PeerIdentity | None = None, expected: PeerIdentity | None = None
) -> None:
    """Refuse a peer whose certificate disagrees with its claim or with who we meant to reach."""
    if claimed is not None and claimed != certified:
        raise AuthError(f"peer claims {claimed} but its certificate says {certified}")
    if expected is not None and expected != certified:
        raise AuthError(f"expected peer {expected}, certificate says {certified}")


def verify_issued_by(cert: x509.Certificate, ca: x509.Certificate, now: dt.datetime) -> None:
    """Chain check for places where the TLS library does not verify (QUIC client certificates)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise AuthError(f"peer certificate not issued by the trusted CA: {exc}") from exc
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise AuthError("peer certificate is outside its validity period")
