"""The hello handshake that opens every pddlink connection, as a sans-I/O state machine.

Theory of operation: the initiator (the side that connected) sends ``Hello`` at once; the responder
answers ``HelloAccept`` when it speaks the same wire version and hash scheme, else ``HelloRefuse``
with the reason (VERSION_MISMATCH or HASH_SCHEME_MISMATCH) and fails. The initiator is established
on ``HelloAccept`` (after checking it agrees) and fails on ``HelloRefuse`` with a ``HandshakeRefused``
carrying the peer's code and text. Any other message before that, or no answer before
``timeout_s``, fails the handshake too. States::

    initiator: HELLO_SENT --accept--> ESTABLISHED        responder: AWAIT_HELLO --ok hello--> ESTABLISHED
               HELLO_SENT --refuse/bad/timeout--> FAILED            AWAIT_HELLO --bad/timeout--> FAILED

Drive it with ``receive(msg, now)``, send what ``messages_to_send()`` returns, and arm ``get_timer()``
(call ``handle_timer(now)`` when it expires). Once FAILED, ``error`` says why; close the connection
after sending the queued messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from pddlink.errors import ConfigError, ErrorCode, PddlinkError
from pddlink.kv.hashing import SUPPORTED_SCHEMES, HashScheme
from pddlink.wire.errors import HandshakeFailed, HandshakeRefused
from pddlink.wire.fields import ListOf, Str
from pddlink.wire.frame import WIRE_VERSION, WireMessage
from pddlink.wire.messages import Hello, HelloAccept, HelloRefuse


class HandshakeState(Enum):
    HELLO_SENT = "hello_sent"
    AWAIT_HELLO = "await_hello"
    ESTABLISHED = "established"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class HandshakeConfig:
    """This side's identity and what it speaks."""

    peer_id: str
    role: str
    hash_scheme: HashScheme = HashScheme.XXH3_128_U32LE_V1
    capabilities: tuple[str, ...] = ()
    wire_version: int = WIRE_VERSION
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        Str(256).check("HandshakeConfig.peer_id", self.peer_id)
        Str(32).check("HandshakeConfig.role", self.role)
        caps = ListOf(Str(64), 64).check("HandshakeConfig.capabilities", self.capabilities)
        object.__setattr__(self, "capabilities", caps)
        if not 0 < self.wire_version < 256:
            raise ConfigError(f"HandshakeConfig.wire_version must be in [1, 255], got {self.wire_version}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"HandshakeConfig.timeout_s must be positive, got {self.timeout_s}")


class Handshake:
    """One side of the hello exchange on one connection."""

    def __init__(self, config: HandshakeConfig, *, initiator: bool, now: float) -> None:
        self.config = config
        self.initiator = initiator
        self.deadline = now + config.timeout_s
        self.peer: Hello | HelloAccept | None = None
        self.capabilities: frozenset[str] = frozenset()
        self.error: PddlinkError | None = None
        self._out: list[WireMessage] = []
        if initiator:
            self.state = HandshakeState.HELLO_SENT
            self._out.append(self._hello())
        else:
            self.state = HandshakeState.AWAIT_HELLO

    @property
    def established(self) -> bool:
        return self.state is HandshakeState.ESTABLISHED

    @property
    def done(self) -> bool:
        return self.state in (HandshakeState.ESTABLISHED, HandshakeState.FAILED)

    def messages_to_send(self) -> list[WireMessage]:
        out, self._out = self._out, []
        return out

    def get_timer(self) -> float | None:
        return None if self.done else self.deadline

    def handle_timer(self, now: float) -> None:
        if not self.done and now >= self.deadline:
            reason = f"no handshake answer within {self.config.timeout_s} s"
            self._fail(HandshakeFailed(reason, code=ErrorCode.DEADLINE_EXCEEDED))

    def receive(self, msg: WireMessage, now: float) -> None:
        """Feed one message received on the connection while the handshake is not done."""
        if self.done:
            raise HandshakeFailed(f"handshake already {self.state.value}; {type(msg).__name__} is not for it")
        if self.state is HandshakeState.AWAIT_HELLO and isinstance(msg, Hello):
            self._on_hello(msg)
        elif self.state is HandshakeState.HELLO_SENT and isinstance(msg, HelloAccept):
            self._on_accept(msg)
        elif self.state is HandshakeState.HELLO_SENT and isinstance(msg, HelloRefuse):
            self._fail(HandshakeRefused(f"peer refused: {msg.reason}", code=msg.code))
        else:
            self._fail(HandshakeFailed(f"{type(msg).__name__} received during the handshake"))

    # --- internals ----------------------------------------------------------------------------

    def _hello(self) -> Hello:
        c = self.config
        return Hello(c.peer_id, c.role, c.wire_version, int(c.hash_scheme), c.capabilities)

    def _mismatch(self, wire_version: int, hash_scheme: int) -> tuple[ErrorCode, str] | None:
        c = self.config
        if wire_version != c.wire_version:
            reason = f"wire version {wire_version}, this side speaks {c.wire_version}"
            return ErrorCode.VERSION_MISMATCH, reason
        if hash_scheme not in SUPPORTED_SCHEMES:
            return ErrorCode.HASH_SCHEME_MISMATCH, f"unknown hash scheme {hash_scheme}"
        if hash_scheme != int(c.hash_scheme):
            return ErrorCode.HASH_SCHEME_MISMATCH, (
                f"hash scheme {hash_scheme}, this side hashes with {int(c.hash_scheme)}"
            )
        return None

    def _on_hello(self, hello: Hello) -> None:
        problem = self._mismatch(hello.wire_version, hello.hash_scheme)
        if problem is not None:
            code, reason = problem
            self._out.append(HelloRefuse(code, reason, self.config.wire_version))
            self._fail(HandshakeFailed(f"refused {hello.peer_id!r}: {reason}", code=code))
            return
        self.peer = hello
        self.capabilities = frozenset(hello.capabilities) & frozenset(self.config.capabilities)
        c = self.config
        agreed = tuple(sorted(self.capabilities))
        self._out.append(HelloAccept(c.peer_id, c.role, c.wire_version, int(c.hash_scheme), agreed))
        self.state = HandshakeState.ESTABLISHED

    def _on_accept(self, accept: HelloAccept) -> None:
        problem = self._mismatch(accept.wire_version, accept.hash_scheme)
        if problem is not None:
            self._fail(HandshakeFailed(f"peer accepted with {problem[1]}", code=problem[0]))
            return
        self.peer = accept
        self.capabilities = frozenset(accept.capabilities) & frozenset(self.config.capabilities)
        self.state = HandshakeState.ESTABLISHED

    def _fail(self, error: PddlinkError) -> None:
        self.error = error
        self.state = HandshakeState.FAILED
