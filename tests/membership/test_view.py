"""MembershipView in memory: snapshots and watch events in, changes out; stale bookkeeping on an
injected clock; malformed entries ignored and counted. No etcd, no event loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_record import md0

from pddlink.membership import (
    KeyDeleted,
    KeyPut,
    MemberAdded,
    MemberChanged,
    MemberRemoved,
    MembershipKeys,
    MembershipView,
    MemberState,
    Snapshot,
    encode_record,
)
from pddlink.roles import Role

KEYS = MembershipKeys("c1")
MD0 = md0()
MD1 = md0(name="md1", identity="md/md1")
P0 = md0(role=Role.P, name="p0", identity="p/p0", datacenter="dc-a")


def entry(rec: object) -> tuple[bytes, bytes]:
    assert hasattr(rec, "member_id")
    return KEYS.key_for(rec), encode_record(rec)  # type: ignore[arg-type]


def synced(*records: object, revision: int = 10, now: float = 0.0) -> MembershipView:
    view = MembershipView(KEYS, stale_after_s=3.0)
    view.apply(Snapshot(tuple(entry(r) for r in records), revision), now)
    return view


def test_snapshot_adds_every_member_and_syncs() -> None:
    view = MembershipView(KEYS)
    assert view.stale(0.0) and view.last_ok_s is None
    changes = view.apply(Snapshot((entry(MD0), entry(P0)), 7), 1.0)
    assert changes == [MemberAdded(MD0), MemberAdded(P0)]
    assert dict(view.members) == {"md/md0": MD0, "p/p0": P0}
    assert not view.stale(1.0) and view.last_ok_s == 1.0 and view.revision == 7


def test_watch_events_add_change_and_remove() -> None:
    view = synced(MD0)
    draining = MD0.with_state(MemberState.DRAINING)
    assert view.apply(KeyPut(*entry(MD1), revision=11), 1) == [MemberAdded(MD1)]
    assert view.apply(KeyPut(*entry(draining), revision=12), 1) == [MemberChanged(MD0, draining)]
    assert view.apply(KeyPut(*entry(draining), revision=13), 1) == []  # same record again
    assert view.apply(KeyDeleted(KEYS.key_for(MD1), revision=14), 1) == [MemberRemoved(MD1)]
    assert view.apply(KeyDeleted(KEYS.key_for(MD1), revision=15), 1) == []
    assert dict(view.members) == {"md/md0": draining} and view.revision == 15


def test_events_already_in_the_snapshot_are_ignored() -> None:
    view = synced(MD0, revision=10)
    assert view.apply(KeyDeleted(KEYS.key_for(MD0), revision=10), 1) == []
    assert view.apply(KeyDeleted(KEYS.key_for(MD0), revision=9), 1) == []
    assert "md/md0" in view.members


def test_resync_reports_what_changed_while_away() -> None:
    view = synced(MD0, P0)
    view.mark_error(5.0, "etcd: unreachable")
    assert view.stale(5.0) and dict(view.members) == {"md/md0": MD0, "p/p0": P0}  # last view kept
    draining = P0.with_state(MemberState.DRAINING)
    changes = view.apply(Snapshot((entry(draining), entry(MD1)), 40), 9.0)
    assert changes == [MemberRemoved(MD0), MemberChanged(P0, draining), MemberAdded(MD1)]
    assert not view.stale(9.0)
    health = view.health(9.0)
    assert (health.error_count, health.last_error, health.members, health.revision) == (
        1,
        "etcd: unreachable",
        2,
        40,
    )


def test_stale_without_news_after_stale_after_s() -> None:
    view = synced(MD0, now=0.0)
    assert not view.stale(3.0) and view.stale(3.1)
    view.mark_ok(3.05)
    assert not view.stale(6.0)
    view.mark_error(6.0, "x")
    view.mark_ok(6.1)  # a late answer from the failed session does not make it fresh
    assert view.stale(6.1) and view.last_ok_s == 3.05


BAD_VALUES = [b"garbage", b"{}", encode_record(MD1)]  # the last: md1's record under md0's key


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_malformed_put_is_counted_and_removes_the_member_it_replaces(value: bytes) -> None:
    view = synced(MD0, P0)
    assert view.apply(KeyPut(KEYS.key_for(MD0), value, 11), 1) == [MemberRemoved(MD0)]
    assert view.malformed_count == 1 and view.health(1).malformed_now == 1 and view.last_malformed
    assert view.apply(KeyPut(*entry(MD0), revision=12), 1) == [MemberAdded(MD0)]  # repaired
    assert view.health(1).malformed_now == 0 and view.malformed_count == 1


def test_malformed_keys_and_values_in_a_snapshot_are_skipped_and_counted_once() -> None:
    bad = ((KEYS.members_prefix + b"router/r0", encode_record(MD0)), (KEYS.key_for(MD1), b"\xff"))
    view = MembershipView(KEYS)
    assert view.apply(Snapshot((entry(MD0), *bad), 5), 0) == [MemberAdded(MD0)]
    assert view.malformed_count == 2 and view.health(0).malformed_now == 2
    assert view.apply(Snapshot((entry(MD0), *bad), 6), 1) == []  # re-read: not counted again
    assert view.malformed_count == 2
    assert view.apply(KeyDeleted(KEYS.key_for(MD1), 7), 1) == [] and view.health(1).malformed_now == 1


def test_stale_after_s_must_be_positive() -> None:
    with pytest.raises(Exception, match="stale_after_s"):
        MembershipView(KEYS, stale_after_s=0)


PURE = ["record.py", "view.py", "__init__.py"]
IO = {"asyncio", "socket", "ssl", "selectors", "subprocess", "grpc", "aetcd", "torch", "uvloop"}


@pytest.mark.parametrize("module", PURE)
def test_the_record_and_the_view_import_no_io(module: str) -> None:
    path = Path(__file__).resolve().parents[2] / "pddlink" / "membership" / module
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
            roots |= {f"{node.module}.{a.name}" for a in node.names}
    assert not roots & IO
    assert not {
        r
        for r in roots
        if r.startswith(
            (
                "pddlink.membership.etcd",
                "pddlink.membership.registrar",
                "pddlink.membership.watcher",
                "pddlink.transport",
            )
        )
    }
