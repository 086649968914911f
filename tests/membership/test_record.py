"""The member record's JSON codec and key layout: round trips, and every malformed value refused
with InvalidInput (never another exception)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import InvalidInput
from pddlink.membership import (
    MemberAddresses,
    MemberRecord,
    MembershipKeys,
    MemberState,
    decode_record,
    encode_record,
)
from pddlink.roles import Role
from pddlink.transport import PeerIdentity
from pddlink.wire import WIRE_VERSION


def md0(**over: Any) -> MemberRecord:
    fields: dict[str, Any] = {
        "role": Role.MD,
        "datacenter": "dc-b",
        "name": "md0",
        "addresses": MemberAddresses("10.0.0.2:7440", "10.0.0.2:7450", "10.0.0.2:7460"),
        "identity": "md/md0",
        "engine": "torch_ref",
        "wire_version": WIRE_VERSION,
    }
    return MemberRecord(**(fields | over))


def test_round_trip_and_identity_is_a_peer_identity() -> None:
    rec = md0(state=MemberState.DRAINING)
    assert decode_record(encode_record(rec)) == rec
    assert PeerIdentity.parse(rec.identity) == PeerIdentity("md", "md0")
    assert rec.member_id == "md/md0"
    assert rec.with_state(MemberState.SERVING).state is MemberState.SERVING


def test_golden_bytes() -> None:
    rec = md0(addresses=MemberAddresses("[::1]:7440"), wire_version=2)
    assert encode_record(rec) == (
        b'{"addresses":{"admin":"","grpc":"[::1]:7440","kv":""},"datacenter":"dc-b","engine":"torch_ref",'
        b'"format":1,"identity":"md/md0","name":"md0","role":"md","state":"serving","wire_version":2}'
    )


@pytest.mark.parametrize(
    "over",
    [
        {"role": Role.ROUTER},
        {"role": "md"},  # a plain string, not the enum
        {"datacenter": ""},
        {"name": "a/b"},
        {"name": "x" * 65},
        {"identity": "rld/md0"},  # another role's certificate
        {"identity": "md"},
        {"identity": "md/"},
        {"engine": ""},
        {"wire_version": 0},
        {"wire_version": True},
        {"state": "gone"},
        {"addresses": "10.0.0.2:7440"},
    ],
)
def test_invalid_records_are_refused(over: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput):
        md0(**over)


@pytest.mark.parametrize("grpc", ["", "host", "host:0", "host:65536", ":80", "h:8x", "a b:1"])
def test_invalid_addresses_are_refused(grpc: str) -> None:
    with pytest.raises(InvalidInput):
        MemberAddresses(grpc)


def _mutated(change: dict[str, Any]) -> bytes:
    doc = json.loads(encode_record(md0()))
    for key, value in change.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[]",
        b"null",
        b"[" * 100_000,
        _mutated({"format": 2}),
        _mutated({"format": ...}),
        _mutated({"extra": 1}),
        _mutated({"name": ...}),
        _mutated({"role": "router"}),
        _mutated({"role": 1}),
        _mutated({"state": "gone"}),
        _mutated({"wire_version": "2"}),
        _mutated({"wire_version": 2.0}),
        _mutated({"addresses": {"grpc": "h:1"}}),
        _mutated({"addresses": {"grpc": "h:1", "kv": "", "admin": 5}}),
        _mutated({"addresses": "h:1"}),
        _mutated({"identity": "p/md0"}),
    ],
)
def test_malformed_values_raise_invalid_input(data: bytes) -> None:
    with pytest.raises(InvalidInput):
        decode_record(data)


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_invalid_input(data: bytes) -> None:
    with contextlib.suppress(InvalidInput):
        decode_record(data)


@given(st.dictionaries(st.sampled_from(["format", "role", "name", "addresses", "x"]), st.from_type(object)))
def test_any_json_object_decodes_or_raises_invalid_input(doc: dict[str, Any]) -> None:
    try:
        data = json.dumps(doc, default=str).encode()
    except (TypeError, ValueError):
        return
    with contextlib.suppress(InvalidInput):
        decode_record(data)


def test_keys() -> None:
    keys = MembershipKeys("east")
    assert keys.members_prefix == b"/pddlink/east/members/"
    assert keys.key_for(md0()) == b"/pddlink/east/members/md/md0"
    assert keys.member_id_of(b"/pddlink/east/members/md/md0") == "md/md0"
    for bad in (
        b"/pddlink/west/members/md/md0",
        b"/pddlink/east/members/md",
        b"/pddlink/east/members/x/y",
        b"/pddlink/east/members/md/\xff",
        b"/pddlink/east/members/md/a/b",
    ):
        with pytest.raises(InvalidInput):
            keys.member_id_of(bad)
    for cluster, prefix in (("", "/p"), ("a/b", "/p"), ("c", "p"), ("c", "/p/")):
        with pytest.raises(InvalidInput):
            MembershipKeys(cluster, prefix)
