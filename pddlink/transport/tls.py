"""TLS 1.3 with mutual authentication, and a development PKI.

Every sidecar has a certificate issued by the deployment's CA. Its identity is a
``PeerIdentity(role, name)``, written twice in the certificate: as the subject CN ``<role>/<name>``
and as a SAN URI ``pddlink://<role>/<name>``. After a handshake each side reads the identity out of
the peer's verified certificate (``identity_from_certificate``) and checks it against what the peer
claims in its hello and against what this side expects (``check_peer``); a mismatch refuses the
connection before any KV moves.

Lifecycle: ``load_or_create_pki(directory, identities)`` once at start-up (it creates a CA and
per-peer key pairs where files are missing, and reuses them otherwise), then ``TlsConfig`` per
endpoint, then ``server_context()`` / ``client_context()`` for TCP (``ssl``), or the PEM paths for
QUIC. The dev PKI is for labs and tests: keys are written unencrypted (mode 0600).
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pddlink.errors import ConfigError, ErrorCode, InvalidInput, LocalError

URI_SCHEME = "pddlink://"
_VALIDITY = dt.timedelta(days=365)
_CA_FILE, _CA_KEY = "ca.pem", "ca.key"


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


# -- development PKI ---------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fp:
        fp.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{path}: expected an EC private key")
    return key


def _builder(
    subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )


def create_ca(directory: Path, name: str = "pddlink dev CA") -> Path:
    """Write a self-signed CA (``ca.pem``, ``ca.key``) into ``directory``; returns the cert path."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    _write_private(directory / _CA_KEY, _key_pem(key))
    (directory / _CA_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return directory / _CA_FILE


def issue_peer(directory: Path, identity: PeerIdentity, ca_dir: Path | None = None) -> TlsConfig:
    """Issue a certificate for ``identity`` signed by the CA in ``ca_dir`` (default: ``directory``)."""
    ca_dir = ca_dir or directory
    ca_cert = x509.load_pem_x509_certificate((ca_dir / _CA_FILE).read_bytes())
    ca_key = _load_key(ca_dir / _CA_KEY)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.common_name)])
    cert = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]), critical=False
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    stem = f"{identity.role}-{identity.name}"
    _write_private(directory / f"{stem}.key", _key_pem(key))
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return TlsConfig(identity, directory / f"{stem}.pem", directory / f"{stem}.key", ca_dir / _CA_FILE)


def load_or_create_peer(directory: Path, identity: PeerIdentity) -> TlsConfig:
    """The credentials of ``identity`` in ``directory``, creating the CA and/or the peer as needed."""
    directory = Path(directory)
    if not (directory / _CA_FILE).is_file():
        create_ca(directory)
    stem = f"{identity.role}-{identity.name}"
    cert, key = directory / f"{stem}.pem", directory / f"{stem}.key"
    if cert.is_file() and key.is_file():
        return TlsConfig(identity, cert, key, directory / _CA_FILE)
    return issue_peer(directory, identity)


def load_or_create_pki(directory: Path, identities: list[PeerIdentity]) -> dict[PeerIdentity, TlsConfig]:
    """Credentials for every identity, sharing one CA in ``directory``."""
    return {identity: load_or_create_peer(Path(directory), identity) for identity in identities}
