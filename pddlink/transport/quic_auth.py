"""Client authentication for QUIC, bound to the server-authenticated connection.

aioquic can request a client certificate only through a test-only flag and does not verify it;
qh3 cannot request one at all. So the QUIC adapter authenticates the client itself, on the control
stream, before the pddlink hello:

    client -> server   CLIENT_OPEN (8 bytes; opens the stream)
    server -> client   SERVER_CHALLENGE (8 bytes) + nonce (32 random bytes)
    client -> server   u16 len + certificate (DER) + u16 len + signature
                       signature = ECDSA-SHA256 over  CONTEXT + nonce + SHA-256(server certificate DER)

The server checks the certificate is issued by its CA and valid now, and the signature with the
certificate's key; the identity in it must then equal the hello's claim. The nonce makes each proof
good for one connection, and the server-certificate hash binds it to the server the client verified
(a relay terminating TLS with another certificate cannot reuse it). The server's certificate is
checked by the client against the same CA and the expected identity right after the QUIC handshake.
``ChallengeReader`` / ``ProofReader`` are sans-I/O: bytes in, a result or ``None`` (need more) out.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import struct

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pddlink.transport.tls import (
    AuthError,
    PeerIdentity,
    TlsConfig,
    identity_from_certificate,
    verify_issued_by,
)

CLIENT_OPEN = b"PDLQAUTH"
SERVER_CHALLENGE = b"PDLQNONC"
CONTEXT = b"pddlink/quic-client-auth/v1"
NONCE_BYTES = 32
_U16 = struct.Struct("<H")
_MAX_BLOCK = 8192


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _signed_bytes(nonce: bytes, server_cert_der: bytes) -> bytes:
    return CONTEXT + nonce + hashlib.sha256(server_cert_der).digest()


def make_proof(tls: TlsConfig, nonce: bytes, server_cert_der: bytes) -> bytes:
    """The client's answer to a challenge: its certificate and signature, length-prefixed."""
    key = serialization.load_pem_private_key(tls.key_file.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise AuthError(f"{tls.key_file}: QUIC client auth needs an EC key")
    cert = x509.load_pem_x509_certificate(tls.cert_file.read_bytes()).public_bytes(serialization.Encoding.DER)
    signature = key.sign(_signed_bytes(nonce, server_cert_der), ec.ECDSA(hashes.SHA256()))
    return _U16.pack(len(cert)) + cert + _U16.pack(len(signature)) + signature


def check_server(cert_der: bytes | None, tls: TlsConfig, expected: PeerIdentity | None) -> PeerIdentity:
    """Verify the server certificate the QUIC handshake presented; returns its identity."""
    if not cert_der:
        raise AuthError("QUIC server presented no certificate")
    cert = x509.load_der_x509_certificate(cert_der)
    verify_issued_by(cert, tls.ca_certificate(), dt.datetime.now(dt.UTC))
    identity = identity_from_certificate(cert)
    if expected is not None and identity != expected:
        raise AuthError(f"expected peer {expected}, certificate says {identity}")
    return identity


def verify_proof(
    cert_der: bytes, signature: bytes, nonce: bytes, server_cert_der: bytes, tls: TlsConfig
) -> PeerIdentity:
    """Check a client's proof; returns the identity its certificate names."""
    try:
        cert = x509.load_der_x509_certificate(cert_der)
    except ValueError as exc:
        raise AuthError(f"client certificate does not parse: {exc}") from exc
    verify_issued_by(cert, tls.ca_certificate(), dt.datetime.now(dt.UTC))
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise AuthError("client certificate key is not EC")
    try:
        public.verify(signature, _signed_bytes(nonce, server_cert_der), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature as exc:
        raise AuthError("client proof signature is invalid") from exc
    return identity_from_certificate(cert)


class PrefixReader:
    """Collects a fixed-size prefix, then hands back the bytes after it."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._buf = bytearray()

    def feed(self, data: bytes) -> tuple[bytes, bytes] | None:
        """``(prefix, rest)`` once ``size`` bytes arrived, else None."""
        self._buf += data
        if len(self._buf) < self._size:
            return None
        whole = bytes(self._buf)
        return whole[: self._size], whole[self._size :]


class ProofReader:
    """Parses the client's length-prefixed certificate + signature block."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> tuple[bytes, bytes, bytes] | None:
        """``(certificate, signature, rest)`` once complete, else None. Oversized -> AuthError."""
        self._buf += data
        buf = bytes(self._buf)
        if len(buf) < 2:
            return None
        (cert_len,) = _U16.unpack_from(buf)
        if cert_len > _MAX_BLOCK:
            raise AuthError("client certificate block too large")
        if len(buf) < 2 + cert_len + 2:
            return None
        (sig_len,) = _U16.unpack_from(buf, 2 + cert_len)
        end = 4 + cert_len + sig_len
        if sig_len > 512:
            raise AuthError("client signature too large")
        if len(buf) < end:
            return None
        return buf[2 : 2 + cert_len], buf[4 + cert_len : end], buf[end:]
