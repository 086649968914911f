"""One member of a deployment as etcd holds it: the record, its JSON codec and its key.

A sidecar writes its ``MemberRecord`` under ``<prefix>/<cluster>/members/<role>/<name>`` (see
``MembershipKeys``), attached to a lease it keeps alive; routers read every key under the members
prefix. Decoding is strict: any value that is not exactly a record of this format raises
``InvalidInput``, so a reader can count it and skip it instead of guessing. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from pddlink.errors import InvalidInput
from pddlink.roles import SIDECAR_ROLES, Role

RECORD_FORMAT = 1  # bump on an incompatible change; readers refuse formats they do not know
_NAME_MAX = 64
_FIELDS = ("format", "role", "datacenter", "name", "identity", "engine", "wire_version", "state", "addresses")
_ADDRESS_FIELDS = ("grpc", "kv", "admin")


class MemberState(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"  # finishes what it holds, takes nothing new


def _check_name(value: str, what: str) -> str:
    """The rules of ``pddlink.transport.PeerIdentity``: 1-64 printable characters, no '/'."""
    if (
        not isinstance(value, str)
        or not value
        or "/" in value
        or not value.isprintable()
        or len(value) > _NAME_MAX
        or value != value.strip()
    ):
        raise InvalidInput(f"member {what} {value!r}: 1-64 printable characters, no '/', no edge spaces")
    return value


def _check_hostport(value: str, what: str) -> str:
    host, sep, port = value.rpartition(":")
    ok = bool(sep and host and port.isdigit() and 0 < int(port) < 65536) and " " not in value
    if not ok or len(value) > 255:
        raise InvalidInput(f"member address {what} must be 'host:port', got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class MemberAddresses:
    """Where peers reach the member: its gRPC service, its KV server (RLD and MD; "" for none) and its
    admin HTTP port ("" when off)."""

    grpc: str
    kv: str = ""
    admin: str = ""

    def __post_init__(self) -> None:
        _check_hostport(self.grpc, "grpc")
        for what in ("kv", "admin"):
            if getattr(self, what):
                _check_hostport(getattr(self, what), what)


@dataclass(frozen=True, slots=True)
class MemberRecord:
    """What a sidecar announces. ``identity`` is the ``role/name`` its TLS certificate must carry
    (``pddlink.transport.PeerIdentity``); its role must be the member's role."""

    role: Role
    datacenter: str
    name: str
    addresses: MemberAddresses
    identity: str
    engine: str
    wire_version: int
    state: MemberState = MemberState.SERVING

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role) or self.role not in SIDECAR_ROLES:
            raise InvalidInput(
                f"member role {self.role!r}: one of {', '.join(r.value for r in SIDECAR_ROLES)}"
            )
        if not isinstance(self.addresses, MemberAddresses):
            raise InvalidInput(f"member addresses {self.addresses!r}: a MemberAddresses")
        _check_name(self.datacenter, "datacenter")
        _check_name(self.name, "name")
        _check_name(self.engine, "engine")
        id_role, sep, id_name = self.identity.partition("/")
        if not sep or id_role != self.role.value:
            raise InvalidInput(f"member identity {self.identity!r}: expected '{self.role.value}/<name>'")
        _check_name(id_name, "identity name")
        if type(self.wire_version) is not int or not 0 < self.wire_version < 256:
            raise InvalidInput(f"member wire_version {self.wire_version!r}: an integer 1-255")
        if not isinstance(self.state, MemberState):
            raise InvalidInput(f"member state {self.state!r}: serving or draining")

    @property
    def member_id(self) -> str:
        """``role/name``: unique within a cluster (it is the tail of the member's key)."""
        return f"{self.role.value}/{self.name}"

    def with_state(self, state: MemberState) -> MemberRecord:
        return replace(self, state=state)


def encode_record(record: MemberRecord) -> bytes:
    doc = {
        "format": RECORD_FORMAT,
        "role": record.role.value,
        "datacenter": record.datacenter,
        "name": record.name,
        "identity": record.identity,
        "engine": record.engine,
        "wire_version": record.wire_version,
        "state": record.state.value,
        "addresses": {f: getattr(record.addresses, f) for f in _ADDRESS_FIELDS},
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _typed(doc: dict[str, Any], key: str, kind: type) -> Any:
    value = doc.get(key)
    if type(value) is not kind:
        raise InvalidInput(f"member record field {key!r}: expected {kind.__name__}, got {value!r}")
    return value


def _exact_keys(doc: Any, expected: tuple[str, ...], what: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or set(doc) != set(expected):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise InvalidInput(f"{what}: expected fields {sorted(expected)}, got {got}")
    return doc


def decode_record(data: bytes) -> MemberRecord:
    """The record in ``data``; ``InvalidInput`` for anything else (not JSON, wrong fields or types,
    an unknown format, role or state)."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidInput(f"member record is not JSON: {exc}") from None
    if isinstance(doc, dict) and doc.get("format") != RECORD_FORMAT:
        raise InvalidInput(f"member record format {doc.get('format')!r}: this reader knows {RECORD_FORMAT}")
    doc = _exact_keys(doc, _FIELDS, "member record")
    addrs = _exact_keys(doc["addresses"], _ADDRESS_FIELDS, "member record addresses")
    try:
        role, state = Role(_typed(doc, "role", str)), MemberState(_typed(doc, "state", str))
    except ValueError as exc:
        raise InvalidInput(f"member record: {exc}") from None
    return MemberRecord(
        role=role,
        datacenter=_typed(doc, "datacenter", str),
        name=_typed(doc, "name", str),
        addresses=MemberAddresses(**{f: _typed(addrs, f, str) for f in _ADDRESS_FIELDS}),
        identity=_typed(doc, "identity", str),
        engine=_typed(doc, "engine", str),
        wire_version=_typed(doc, "wire_version", int),
        state=state,
    )


@dataclass(frozen=True, slots=True)
class MembershipKeys:
    """The key layout of one cluster: ``<prefix>/<cluster>/members/<role>/<name>``."""

    cluster: str
    prefix: str = "/pddlink"

    def __post_init__(self) -> None:
        _check_name(self.cluster, "cluster")
        if not self.prefix.startswith("/") or self.prefix.endswith("/") or not self.prefix.isprintable():
            raise InvalidInput(f"membership prefix {self.prefix!r}: starts with '/', does not end with one")

    @property
    def members_prefix(self) -> bytes:
        return f"{self.prefix}/{self.cluster}/members/".encode()

    def key_for(self, record: MemberRecord) -> bytes:
        return self.members_prefix + record.member_id.encode()

    def member_id_of(self, key: bytes) -> str:
        """``role/name`` from a key under ``members_prefix``; ``InvalidInput`` for any other key."""
        if not key.startswith(self.members_prefix):
            raise InvalidInput(f"membership key {key!r} is not under {self.members_prefix!r}")
        try:
            tail = key[len(self.members_prefix) :].decode()
        except UnicodeDecodeError:
            raise InvalidInput(f"membership key {key!r} is not UTF-8") from None
        role, sep, name = tail.partition("/")
        if not sep or role not in {r.value for r in SIDECAR_ROLES}:
            raise InvalidInput(f"membership key {key!r}: expected .../members/<role>/<name>")
        _check_name(name, "name in key")
        return tail
