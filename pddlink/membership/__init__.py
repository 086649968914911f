"""Membership that changes at run time: sidecars announce themselves in etcd, routers follow.

``record`` (the member record, its JSON codec and key layout) and ``view`` (the router's view as a
sans-I/O machine) are pure; ``etcd`` is the asyncio adapter (``Registrar`` for a sidecar,
``MembershipWatcher`` for a router), imported on its own so that the pure part needs no etcd client.
"""

from pddlink.membership.record import (
    RECORD_FORMAT,
    MemberAddresses,
    MemberRecord,
    MembershipKeys,
    MemberState,
    decode_record,
    encode_record,
)
from pddlink.membership.view import (
    KeyDeleted,
    KeyPut,
    MemberAdded,
    MemberChanged,
    MemberRemoved,
    MembershipChange,
    MembershipHealth,
    MembershipView,
    Snapshot,
    StoreEvent,
)

__all__ = [
    "RECORD_FORMAT",
    "KeyDeleted",
    "KeyPut",
    "MemberAdded",
    "MemberAddresses",
    "MemberChanged",
    "MemberRecord",
    "MemberRemoved",
    "MemberState",
    "MembershipChange",
    "MembershipHealth",
    "MembershipKeys",
    "MembershipView",
    "Snapshot",
    "StoreEvent",
    "decode_record",
    "encode_record",
]
