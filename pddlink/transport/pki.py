"""The development PKI: a CA the operator keeps, and one directory per node with its own credentials.

Layout (every mode is set explicitly, whatever the process umask)::

    CA_DIR/            0700   the operator's: ca.key never leaves it
        ca.key         0600
        ca.pem         0644
    NODE_DIR/          0700   one per node (its --tls-dir): no CA key, so a node cannot mint identities
        ca.pem         0644   the CA it trusts
        <role>-<name>.pem  0644
        <role>-<name>.key  0600

Lifecycle: ``create_ca(ca_dir)`` once, ``issue_node(ca_dir, node_dir, identity)`` per node (the
``pddlink pki`` command does both), then each process ``load_node(node_dir, identity)`` at start-up:
it only reads, and refuses a directory that holds a CA key or a private key others can read.
``load_or_create_pki(root, identities)`` does all of it under ``root`` (``root/ca`` and
``root/<role>-<name>``) for tests, benches and the demo. Keys are written unencrypted.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pddlink.errors import ConfigError
from pddlink.transport.tls import PeerIdentity, TlsConfig

CA_CERT, CA_KEY = "ca.pem", "ca.key"
DIR_MODE, KEY_MODE, CERT_MODE = 0o700, 0o600, 0o644
_VALIDITY = dt.timedelta(days=365)


class PkiError(ConfigError):
    """A PKI directory is missing a file, holds what it must not, or has unsafe modes."""


def stem(identity: PeerIdentity) -> str:
    return f"{identity.role}-{identity.name}"


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter (created where missing)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` with exactly ``mode``: created with it and set again (the umask cuts the first)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fp:
        os.fchmod(fp.fileno(), mode)
        fp.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{path}: expected an EC private key")
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


def create_ca(ca_dir: Path, name: str = "pddlink dev CA") -> Path:
    """Write a self-signed CA (``ca.pem``, ``ca.key``) into ``ca_dir``; returns the cert path."""
    private_dir(ca_dir)
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
    write_file(ca_dir / CA_KEY, _key_pem(key), KEY_MODE)
    write_file(ca_dir / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), CERT_MODE)
    return ca_dir / CA_CERT


def issue_node(ca_dir: Path, node_dir: Path, identity: PeerIdentity) -> TlsConfig:
    """A key and certificate for ``identity`` signed by the CA in ``ca_dir``, written with the CA's
    certificate (never its key) into ``node_dir``."""
    if Path(node_dir).resolve() == Path(ca_dir).resolve():
        raise PkiError(f"{node_dir}: a node's directory must not be the CA's (it would hold ca.key)")
    for name in (CA_CERT, CA_KEY):
        if not (ca_dir / name).is_file():
            raise PkiError(f"{ca_dir}: no {name} (create the CA first: pddlink pki init {ca_dir})")
    ca_pem = (ca_dir / CA_CERT).read_bytes()
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
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
        .sign(_load_key(ca_dir / CA_KEY), hashes.SHA256())
    )
    private_dir(node_dir)
    write_file(node_dir / f"{stem(identity)}.key", _key_pem(key), KEY_MODE)
    write_file(node_dir / f"{stem(identity)}.pem", cert.public_bytes(serialization.Encoding.PEM), CERT_MODE)
    write_file(node_dir / CA_CERT, ca_pem, CERT_MODE)
    return load_node(node_dir, identity)


def load_node(tls_dir: Path, identity: PeerIdentity) -> TlsConfig:
    """The credentials of ``identity`` in its node directory; reads only, never mints.

    Refuses a directory holding a CA key (any node could then mint any identity) and a private key
    that group or others may read (as ssh does)."""
    tls_dir = Path(tls_dir)
    cert, key, ca = tls_dir / f"{stem(identity)}.pem", tls_dir / f"{stem(identity)}.key", tls_dir / CA_CERT
    held = (
        ca_key_in(tls_dir, ca)
        if ca.is_file()
        else ((tls_dir / CA_KEY) if (tls_dir / CA_KEY).exists() else None)
    )
    if held is not None:
        raise PkiError(
            f"{tls_dir} holds the CA key ({held.name}): a node's tls_dir must hold only its own key, its "
            "certificate and ca.pem (move the CA out; issue nodes with `pddlink pki issue`)"
        )
    for path in (cert, key, ca):
        if not path.is_file():
            raise PkiError(
                f"{tls_dir}: no {path.name} for {identity.common_name} "
                f"(issue it: pddlink pki issue --ca CA_DIR --out {tls_dir} {identity.common_name})"
            )
    if stat.S_IMODE(key.stat().st_mode) & 0o077:
        raise PkiError(f"{key}: private key readable by group or others (chmod 600 {key})")
    return TlsConfig(identity, cert, key, ca)


def ca_key_in(directory: Path, ca_cert: Path) -> Path | None:
    """The file in ``directory`` that holds the private key of ``ca_cert``, whatever its name (a
    copy kept as ``ca-backup.key`` is as dangerous as ``ca.key``): None when there is none."""
    try:
        ca_public = x509.load_pem_x509_certificate(ca_cert.read_bytes()).public_key()
    except (OSError, ValueError):
        return None  # no readable CA certificate: loading the node fails on it next
    wanted = ca_public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.stat().st_size > 64 << 10:
            continue
        data = path.read_bytes()
        if b"PRIVATE KEY" not in data:
            continue
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            continue  # encrypted or not a key: it cannot sign for the CA here
        public = private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if public == wanted:
            return path
    return None


def load_or_create_pki(root: Path, identities: list[PeerIdentity]) -> dict[PeerIdentity, TlsConfig]:
    """Dev/test shortcut: the CA in ``root/ca``, each identity in ``root/<role>-<name>``, created
    where missing and reused otherwise."""
    root = private_dir(Path(root))
    ca_dir = root / "ca"
    if not (ca_dir / CA_CERT).is_file():
        create_ca(ca_dir)
    out = {}
    for identity in identities:
        node = node_dir(root, identity)
        if (node / f"{stem(identity)}.pem").is_file() and (node / f"{stem(identity)}.key").is_file():
            out[identity] = load_node(node, identity)
        else:
            out[identity] = issue_node(ca_dir, node, identity)
    return out


def node_dir(root: Path, identity: PeerIdentity) -> Path:
    """Where ``load_or_create_pki(root, ...)`` keeps ``identity``'s node directory."""
    return Path(root) / stem(identity)


def load_or_create_peer(root: Path, identity: PeerIdentity) -> TlsConfig:
    """One identity of the dev PKI under ``root`` (see ``load_or_create_pki``)."""
    return load_or_create_pki(root, [identity])[identity]
