"""The hello handshake between two in-memory peers (messages cross as real frame bytes)."""

from __future__ import annotations

import pytest

from pddlink.errors import ConfigError, ErrorCode, InvalidInput
from pddlink.kv.hashing import HashScheme
from pddlink.wire import (
    WIRE_VERSION,
    Decoder,
    Handshake,
    HandshakeConfig,
    HandshakeFailed,
    HandshakeRefused,
    HandshakeState,
    Hello,
    HelloRefuse,
    Ping,
    encode,
)


def exchange(a: Handshake, b: Handshake, now: float = 0.0) -> None:
    """Carry frames both ways until neither side has anything to send."""
    da, db = Decoder(), Decoder()
    for _ in range(4):
        moved = False
        for src, dst, dec in ((a, b, db), (b, a, da)):
            for msg in src.messages_to_send():
                moved = True
                for got in dec.feed(encode(msg)):
                    if not dst.done:
                        dst.receive(got, now)
        if not moved:
            return


def pair(
    client: HandshakeConfig | None = None, server: HandshakeConfig | None = None
) -> tuple[Handshake, Handshake]:
    c = client or HandshakeConfig("p-a", "p", capabilities=("zstd", "striping"))
    s = server or HandshakeConfig("md-b", "md", capabilities=("striping", "quic"))
    return Handshake(c, initiator=True, now=0.0), Handshake(s, initiator=False, now=0.0)


def test_matching_peers_establish_with_common_capabilities() -> None:
    a, b = pair()
    exchange(a, b)
    assert a.state is b.state is HandshakeState.ESTABLISHED
    assert a.capabilities == b.capabilities == frozenset({"striping"})
    assert a.peer is not None and a.peer.peer_id == "md-b" and a.peer.role == "md"
    assert b.peer is not None and b.peer.peer_id == "p-a"
    assert a.get_timer() is None and b.get_timer() is None


def test_version_mismatch_ends_the_handshake_with_a_reason_on_both_sides() -> None:
    a, b = pair(client=HandshakeConfig("p-a", "p", wire_version=WIRE_VERSION + 1))
    exchange(a, b)
    assert a.state is b.state is HandshakeState.FAILED
    assert isinstance(a.error, HandshakeRefused) and a.error.code is ErrorCode.VERSION_MISMATCH
    assert f"wire version {WIRE_VERSION + 1}" in a.error.message
    assert isinstance(b.error, HandshakeFailed) and b.error.code is ErrorCode.VERSION_MISMATCH


def test_unknown_hash_scheme_is_refused_with_a_reason() -> None:
    a, b = pair()
    b.receive(Hello("p-x", "p", WIRE_VERSION, 99), 0.0)
    (refuse,) = b.messages_to_send()
    assert isinstance(refuse, HelloRefuse) and refuse.code is ErrorCode.HASH_SCHEME_MISMATCH
    assert "unknown hash scheme 99" in refuse.reason
    a.messages_to_send()
    a.receive(refuse, 0.0)
    assert a.error is not None and a.error.code is ErrorCode.HASH_SCHEME_MISMATCH


def test_a_different_known_scheme_is_refused_too() -> None:
    _, b = pair()
    b.receive(Hello("p-x", "p", WIRE_VERSION, int(HashScheme.XXH3_128_U32LE_V1) + 1000), 0.0)
    assert b.error is not None and b.error.code is ErrorCode.HASH_SCHEME_MISMATCH


def test_other_messages_during_the_handshake_fail_it() -> None:
    _, b = pair()
    b.receive(Ping(1, 2), 0.0)
    assert b.state is HandshakeState.FAILED and isinstance(b.error, HandshakeFailed)
    with pytest.raises(HandshakeFailed):
        b.receive(Ping(1, 2), 0.0)


def test_no_answer_times_out() -> None:
    a, _ = pair(client=HandshakeConfig("p-a", "p", timeout_s=2.0))
    assert a.get_timer() == 2.0
    a.handle_timer(1.9)
    assert not a.done
    a.handle_timer(2.0)
    assert a.state is HandshakeState.FAILED and a.error is not None
    assert a.error.code is ErrorCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    "kwargs",
    [{"peer_id": "x" * 300}, {"timeout_s": 0.0}, {"wire_version": 0}, {"capabilities": ("c" * 100,)}],
)
def test_bad_config_is_refused(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"peer_id": "p", "role": "p"}
    with pytest.raises(ConfigError if "timeout_s" in kwargs or "wire_version" in kwargs else InvalidInput):
        HandshakeConfig(**{**base, **kwargs})  # type: ignore[arg-type]
