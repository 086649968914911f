"""The one error root of pddlink, and the wire error codes errors carry.

Every error the project raises derives from ``PddlinkError``. ``LocalError`` means this side
detected the problem (bad input, a violated invariant, a timeout); ``RemoteError`` means a peer
reported it (its wire error code and text arrive in an abort or error message). Modules define
their own subclasses next to the code that raises them, always under one of these two.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes that travel on the wire (abort/error messages). Values are stable: never renumber."""

    UNKNOWN = 0
    PROTOCOL = 1  # malformed frame, bad checksum, unexpected message
    VERSION_MISMATCH = 2
    HASH_SCHEME_MISMATCH = 3
    BAD_REQUEST = 4  # invalid input from a client or peer
    NOT_FOUND = 5  # unknown request, transfer, reservation or block
    DEADLINE_EXCEEDED = 6
    CANCELLED = 7
    PEER_UNREACHABLE = 8
    INTEGRITY = 9  # checksum or digest mismatch
    LAYOUT_MISMATCH = 10
    CAPACITY = 11  # no room: KV pool, DRC capacity, window
    LEASE_EXPIRED = 12
    AUTH = 13  # certificate or identity refused
    INTERNAL = 14
    UNAVAILABLE = 15  # transport not installed / device missing


class PddlinkError(Exception):
    """Root of every error pddlink raises. ``code`` is the wire error code."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class LocalError(PddlinkError):
    """Detected on this side."""


class RemoteError(PddlinkError):
    """Reported by a peer; carries the peer's code and text."""


class InvalidInput(LocalError):
    """Input that this side refuses (client request, configuration, profile, file). Changes no state."""

    code = ErrorCode.BAD_REQUEST


class ConfigError(InvalidInput):
    """A configuration value is missing or out of range; the message names the field."""


def require(ok: bool, message: str) -> None:
    """``ConfigError(message)`` unless ``ok``: a value's range check, where the message names it."""
    if not ok:
        raise ConfigError(message)


class NotFound(LocalError):
    code = ErrorCode.NOT_FOUND


class DeadlineExceeded(LocalError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Unavailable(LocalError):
    """A component is not installed or has no device here; the message says what to install."""

    code = ErrorCode.UNAVAILABLE
