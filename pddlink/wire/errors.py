"""Typed errors of the wire layer.

Everything the frame decoder or the handshake can raise derives from ``WireError`` (a
``LocalError`` with wire code ``PROTOCOL`` unless a subclass says otherwise). A decoder that raised
is broken for good: the byte stream has lost its framing, so the connection must be closed (after
sending an ``Error`` message if the transport can). Nothing here ever raises a bare exception.
"""

from __future__ import annotations

from pddlink.errors import ErrorCode, LocalError, RemoteError


class WireError(LocalError):
    """A frame or message this side cannot accept."""

    code = ErrorCode.PROTOCOL


class BadMagic(WireError):
    """The stream does not start a frame where one is expected (not pddlink, or lost framing)."""


class VersionMismatch(WireError):
    """A frame (or a peer's handshake) uses a wire version this side does not speak."""

    code = ErrorCode.VERSION_MISMATCH


class UnknownMessageType(WireError):
    """The header names a message type this version does not define."""


class BadFlags(WireError):
    """Reserved header flag bits are set."""


class FrameTooLarge(WireError):
    """A header announces a body or payload larger than the decoder's configured limit."""

    code = ErrorCode.CAPACITY


class BadChecksum(WireError):
    """Header or body bytes do not match their CRC: corruption on the path or lost framing."""

    code = ErrorCode.INTEGRITY


class MalformedMessage(WireError):
    """A body that passed its checksum but does not decode into a valid message."""


class DecoderBroken(WireError):
    """The decoder already failed; the stream cannot be resynchronised."""


class HandshakeRefused(RemoteError):
    """The peer refused our hello; ``code`` and the message carry its reason."""


class HandshakeFailed(WireError):
    """The handshake could not complete on this side (refused the peer, timed out, wrong order)."""
