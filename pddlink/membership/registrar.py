"""A sidecar's membership entry: its record under an etcd lease that it keeps alive.

Lifecycle: ``start()`` runs a task that grants a lease of ``ttl_s``, puts the record under it and
refreshes the lease every ``keepalive_every_s``. If etcd fails or the lease is gone (etcd was away
longer than the TTL), the task drops its session and registers again, with a new lease, once etcd
answers. ``set_state(DRAINING)`` rewrites the record under the same lease. ``close()`` revokes the
lease, so routers see the member leave at once; a process that dies instead leaves when the lease
expires. The sidecar's own work never waits on etcd: only ``wait_registered`` and ``set_state``
wait, and both for a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from pddlink.errors import ConfigError, DeadlineExceeded, ErrorCode, LocalError
from pddlink.membership.etcd import ETCD_ERRORS, EtcdConfig, EtcdSession
from pddlink.membership.record import MemberRecord, MembershipKeys, MemberState, encode_record


class LeaseLost(LocalError):
    """etcd answered a keepalive with TTL 0: the lease expired; register again with a new one."""

    code = ErrorCode.LEASE_EXPIRED


_RETRY_ERRORS: tuple[type[BaseException], ...] = (*ETCD_ERRORS, LeaseLost)


@dataclass(frozen=True, slots=True)
class RegistrarConfig:
    ttl_s: int = 5  # etcd leases are whole seconds
    keepalive_every_s: float = 0.0  # 0: a third of the TTL

    def __post_init__(self) -> None:
        if type(self.ttl_s) is not int or self.ttl_s < 2:
            raise ConfigError(f"membership ttl_s must be an integer >= 2, got {self.ttl_s!r}")
        if not 0 <= self.keepalive_every_s < self.ttl_s:
            raise ConfigError(
                f"membership keepalive_every_s must be in [0, ttl_s), got {self.keepalive_every_s}"
            )

    @property
    def keepalive_interval_s(self) -> float:
        return self.keepalive_every_s or self.ttl_s / 3


class Registrar:
    def __init__(
        self,
        etcd: EtcdConfig,
        keys: MembershipKeys,
        record: MemberRecord,
        config: RegistrarConfig | None = None,
    ) -> None:
        self.etcd, self.keys, self.config = etcd, keys, config or RegistrarConfig()
        self._record = record
        self._written: MemberRecord | None = None  # what etcd holds under the current lease
        self._wake = asyncio.Event()
        self._written_changed = asyncio.Condition()
        self._session: EtcdSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.lease_id: int | None = None
        self.error_count = 0
        self.last_error = ""

    @property
    def record(self) -> MemberRecord:
        return self._record

    @property
    def key(self) -> bytes:
        return self.keys.key_for(self._record)

    @property
    def registered(self) -> bool:
        """etcd holds the current record under a live lease (as of the last keepalive)."""
        return self._written == self._record

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"registrar {self.key!r}")

    async def wait_registered(self, timeout_s: float) -> None:
        """Until etcd holds the current record; ``DeadlineExceeded`` after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s), self._written_changed:
                await self._written_changed.wait_for(lambda: self.registered)
        except TimeoutError:
            raise DeadlineExceeded(
                f"not registered in etcd within {timeout_s} s: {self.last_error}"
            ) from None

    async def set_state(self, state: MemberState, timeout_s: float = 5.0) -> None:
        """Announce ``state`` (draining: routers place nothing new here); waits until etcd holds it.
        ``DeadlineExceeded`` if etcd is away that long; the state is kept and written once it is back."""
        self._record = self._record.with_state(state)
        self._wake.set()
        await self.wait_registered(timeout_s)

    async def close(self, *, revoke: bool = True) -> None:
        """Stop keeping the lease alive; ``revoke`` deletes the entry now, otherwise it expires
        after the TTL (what a crash looks like to the routers)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        session, self._session = self._session, None
        if session is None:
            return
        if revoke and self.lease_id is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await session.call(session.client.revoke_lease(self.lease_id))
        await session.close()
        await self._set_written(None)

    async def __aenter__(self) -> Registrar:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self) -> None:
        attempt = 0
        while True:
            self._session = session = EtcdSession(self.etcd, attempt)
            try:
                await self._register(session)
                await self._keep_alive(session)
            except _RETRY_ERRORS as exc:
                self.error_count += 1
                self.last_error = f"{session.endpoint}: {type(exc).__name__}: {exc}"
            await self._set_written(None)
            self._session = None
            await session.close()
            attempt += 1
            await asyncio.sleep(self.etcd.retry_interval_s)

    async def _register(self, session: EtcdSession) -> None:
        self.lease_id = None
        lease = await session.call(session.client.lease(self.config.ttl_s))
        self.lease_id = int(lease.id)
        await self._put(session)

    async def _put(self, session: EtcdSession) -> None:
        record = self._record
        await session.call(
            session.client.put(self.keys.key_for(record), encode_record(record), lease=self.lease_id)
        )
        await self._set_written(record)

    async def _keep_alive(self, session: EtcdSession) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.keepalive_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._written != self._record:
                await self._put(session)
            reply = await session.call(session.client.refresh_lease(self.lease_id))
            if reply is None or int(reply.TTL) <= 0:
                raise LeaseLost(f"lease {self.lease_id:x} expired")

    async def _set_written(self, record: MemberRecord | None) -> None:
        async with self._written_changed:
            self._written = record
            self._written_changed.notify_all()
