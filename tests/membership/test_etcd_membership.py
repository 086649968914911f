"""Registrar and MembershipWatcher against a real etcd (Debian's etcd-server, started by the
fixtures on loopback): registration seen within 1 s, a dead registrar gone within its TTL + 1 s,
draining propagated, an etcd outage survived on the last view and resynced, a malformed entry
ignored and counted. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aetcd
import pytest
from _etcd_server import EtcdServer
from test_record import md0

from pddlink.membership import (
    MemberAdded,
    MemberChanged,
    MemberRecord,
    MemberRemoved,
    MembershipChange,
    MembershipKeys,
    MemberState,
)
from pddlink.membership.etcd import EtcdConfig
from pddlink.membership.registrar import Registrar, RegistrarConfig
from pddlink.membership.watcher import MembershipWatcher

TEST_TIMEOUT_S = 30.0
HERE = Path(__file__).resolve().parent


def run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(TEST_TIMEOUT_S):
            await coro

    asyncio.run(bounded())


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` holds; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def md(name: str) -> MemberRecord:
    return md0(name=name, identity=f"md/{name}")


def keys_for(request: pytest.FixtureRequest) -> MembershipKeys:
    return MembershipKeys(request.node.name.replace("[", "-").replace("]", "")[:64])


def watcher(
    etcd: EtcdServer, keys: MembershipKeys, on_change: Callable[[MembershipChange], None] | None = None
) -> MembershipWatcher:
    config = EtcdConfig((etcd.endpoint,), request_timeout_s=1.0, retry_interval_s=0.2)
    return MembershipWatcher(config, keys, on_change=on_change, probe_every_s=0.2, stale_after_s=1.0)


def registrar(etcd: EtcdServer, keys: MembershipKeys, record: MemberRecord, ttl_s: int = 2) -> Registrar:
    config = EtcdConfig((etcd.endpoint,), request_timeout_s=1.0, retry_interval_s=0.2)
    return Registrar(config, keys, record, RegistrarConfig(ttl_s=ttl_s))


def test_a_registered_member_is_seen_within_1s_and_leaves_on_close(
    etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> None:
    keys = keys_for(request)

    async def main() -> None:
        async with watcher(etcd_server, keys) as w:
            await w.wait_synced(5)
            assert dict(w.members) == {} and not w.stale
            changes = w.changes()
            reg = registrar(etcd_server, keys, md("md0"))
            reg.start()
            seen_s = await until(lambda: "md/md0" in w.members, 1.0, "md0 in the watcher's view")
            assert w.members["md/md0"] == reg.record and reg.registered
            assert await asyncio.wait_for(anext(changes), 1) == MemberAdded(reg.record)
            await reg.close()
            await until(lambda: "md/md0" not in w.members, 1.0, "md0 gone after a revoke")
            assert await asyncio.wait_for(anext(changes), 1) == MemberRemoved(reg.record)
            assert (w.error_count, w.malformed_count) == (0, 0)
            print(f"seen after {seen_s:.3f} s")
        assert [c async for c in changes] == []  # closing the watcher ends the stream

    run(main())


def test_draining_propagates(etcd_server: EtcdServer, request: pytest.FixtureRequest) -> None:
    keys = keys_for(request)

    async def main() -> None:
        seen: list[MembershipChange] = []
        async with (
            watcher(etcd_server, keys, seen.append) as w,
            registrar(etcd_server, keys, md("md1")) as reg,
        ):
            await reg.wait_registered(5)
            await until(lambda: "md/md1" in w.members, 1.0, "md1 seen")
            await reg.set_state(MemberState.DRAINING, timeout_s=2)
            await until(lambda: w.members["md/md1"].state is MemberState.DRAINING, 1.0, "md1 draining")
            serving = reg.record.with_state(MemberState.SERVING)
            assert MemberChanged(serving, reg.record) in seen

    run(main())


def test_a_registrar_that_stops_without_revoking_leaves_within_its_ttl(
    etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> None:
    keys = keys_for(request)

    async def main() -> None:
        async with watcher(etcd_server, keys) as w:
            reg = registrar(etcd_server, keys, md("md2"), ttl_s=2)
            reg.start()
            await reg.wait_registered(5)
            await until(lambda: "md/md2" in w.members, 1.0, "md2 seen")
            await reg.close(revoke=False)  # what a crash leaves: a lease nobody refreshes
            gone_s = await until(lambda: "md/md2" not in w.members, 2 + 1.0, "md2 gone within TTL + 1 s")
            assert gone_s > 0.5, "removed at once: that was a revoke, not the lease expiring"

    run(main())


def test_a_sigkilled_sidecar_leaves_within_its_ttl(
    etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> None:
    keys = keys_for(request)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    args = [sys.executable, str(HERE / "_registrar_child.py"), etcd_server.endpoint, keys.cluster, "md3", "2"]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, env=env)
    try:

        async def main() -> None:
            async with watcher(etcd_server, keys) as w:
                assert child.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 20)
                assert line == b"registered\n"
                await until(lambda: "md/md3" in w.members, 1.0, "md3 seen")
                child.send_signal(signal.SIGKILL)
                await until(lambda: "md/md3" not in w.members, 2 + 1.0, "md3 gone within TTL + 1 s")

        run(main())
    finally:
        child.kill()
        child.communicate(timeout=10)  # reaps it and closes its pipe


def test_an_etcd_outage_keeps_the_last_view_then_resyncs(
    own_etcd: EtcdServer, request: pytest.FixtureRequest
) -> None:
    keys = keys_for(request)

    async def main() -> None:
        async with watcher(own_etcd, keys) as w, registrar(own_etcd, keys, md("md4"), ttl_s=5) as reg4:
            await until(lambda: "md/md4" in w.members, 5.0, "md4 seen")
            assert not w.stale
            await asyncio.to_thread(own_etcd.stop)
            await until(lambda: w.stale, 2.0, "the watcher says stale")
            assert "md/md4" in w.members and w.error_count >= 1  # last known membership kept
            reg5 = registrar(own_etcd, keys, md("md5"), ttl_s=5)
            reg5.start()  # added while etcd is away: registers when it is back
            await asyncio.sleep(2.0)
            assert w.stale and "md/md5" not in w.members and not reg5.registered
            await asyncio.to_thread(own_etcd.start)
            back_s = await until(lambda: not w.stale and "md/md5" in w.members, 5.0, "resynced with md5")
            assert "md/md4" in w.members
            await until(lambda: reg4.registered, 5.0, "md4's registrar back")
            assert reg4.error_count >= 1 and reg5.error_count >= 1
            health = w.health()
            assert not health.stale and health.members == 2 and health.last_ok_s is not None
            print(f"resynced {back_s:.2f} s after etcd was back; health {health}")
            await reg5.close()
            await until(lambda: "md/md5" not in w.members, 1.0, "md5 gone: the watch runs again")

    run(main())


def test_a_malformed_entry_is_ignored_and_counted(
    etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> None:
    keys = keys_for(request)
    host, port = etcd_server.endpoint.split(":")

    async def main() -> None:
        async with aetcd.Client(host, int(port), timeout=2) as raw:
            await raw.put(keys.members_prefix + b"md/bad0", b"{not json")  # there before the watcher
            async with watcher(etcd_server, keys) as w:
                await w.wait_synced(5)
                assert dict(w.members) == {} and w.malformed_count == 1
                await raw.put(keys.members_prefix + b"md/bad1", b'{"format": 1}')
                await raw.put(keys.members_prefix + b"router/r0", b"{}")
                await until(lambda: w.malformed_count == 3, 1.0, "two more malformed entries counted")
                async with registrar(etcd_server, keys, md("md6")) as reg:
                    await until(lambda: "md/md6" in w.members, 1.0, "md6 seen after the malformed ones")
                    assert reg.registered
                assert not w.stale and w.health().malformed_now == 3

    run(main())


def test_a_hung_etcd_makes_the_view_stale_without_hanging_anything(
    own_etcd: EtcdServer, request: pytest.FixtureRequest
) -> None:
    """SIGSTOP: etcd keeps its sockets open and answers nothing (a partition looks like this)."""
    keys = keys_for(request)

    async def main() -> None:
        async with watcher(own_etcd, keys) as w, registrar(own_etcd, keys, md("md7"), ttl_s=3) as reg:
            await until(lambda: "md/md7" in w.members, 5.0, "md7 seen")
            own_etcd.pause()
            try:
                await until(lambda: w.stale, 2.5, "stale while etcd answers nothing")
                await until(lambda: not reg.registered, 2.5, "the registrar notices")
                assert "md/md7" in w.members
            finally:
                own_etcd.resume()
            await until(lambda: not w.stale and reg.registered, 5.0, "both back after SIGCONT")
            assert "md/md7" in w.members

    run(main())


def test_a_lost_lease_is_replaced(etcd_server: EtcdServer, request: pytest.FixtureRequest) -> None:
    """The lease is gone while etcd stays up (as after a client-side partition longer than the TTL):
    the next keepalive finds out and the registrar registers again under a new lease."""
    keys = keys_for(request)
    host, port = etcd_server.endpoint.split(":")

    async def main() -> None:
        async with watcher(etcd_server, keys) as w, registrar(etcd_server, keys, md("md8"), ttl_s=3) as reg:
            await reg.wait_registered(5)
            first_lease = reg.lease_id
            async with aetcd.Client(host, int(port), timeout=2) as raw:
                await raw.revoke_lease(first_lease)
            await until(lambda: "md/md8" not in w.members, 1.0, "md8 gone with its lease")
            await until(lambda: "md/md8" in w.members, 3.0, "md8 back under a new lease")
            assert reg.registered and reg.lease_id != first_lease and reg.error_count == 1
            assert "LeaseLost" in reg.last_error  # etcd answered the keepalive with TTL 0

    run(main())
