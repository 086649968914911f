"""What the membership adapters share about etcd: where it is, how long to wait, which errors mean
"etcd is unreachable or refused", and one client session.

The client is ``aetcd`` (asyncio, over grpcio's ``grpc.aio``: etcd's v3 API as etcd 3.4 and 3.5
serve it). Each session is a fresh ``aetcd.Client``: after any failure the adapters drop it and
open another, so no half-broken gRPC stream or watch state survives a reconnect. Every call goes
through ``call`` with a deadline, so nothing waits on an etcd that does not answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import grpc

from pddlink.errors import ConfigError

T = TypeVar("T")

# what "etcd failed or is unreachable" looks like from the client; anything else is a bug and propagates
ETCD_ERRORS: tuple[type[BaseException], ...] = (aetcd.ClientError, grpc.RpcError, OSError, TimeoutError)

_CHANNEL_OPTIONS = {
    # etcd restarted: reconnect within about a second, not after gRPC's default backoff (up to 120 s)
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint must be 'host:port', got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    """Where etcd listens (client URLs as ``host:port``; a reconnect tries the next one) and how
    long any one call may take."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    request_timeout_s: float = 2.0
    retry_interval_s: float = 0.5  # between two attempts to reach etcd

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd endpoints: at least one 'host:port'")
        for text in self.endpoints:
            _endpoint(text)
        if not self.request_timeout_s > 0 or not self.retry_interval_s > 0:
            raise ConfigError("etcd request_timeout_s and retry_interval_s must be > 0")

    @classmethod
    def parse(cls, endpoints: str, **fields: Any) -> EtcdConfig:
        """``"host:port,host:port"`` as a flag or configuration file gives it."""
        return cls(tuple(e.strip() for e in endpoints.split(",") if e.strip()), **fields)


class EtcdSession:
    """One ``aetcd.Client`` on one endpoint; ``call`` bounds every request by the configured deadline."""

    def __init__(self, config: EtcdConfig, attempt: int = 0) -> None:
        self.config = config
        self.endpoint = config.endpoints[attempt % len(config.endpoints)]
        host, port = _endpoint(self.endpoint)
        self.client = aetcd.Client(host, port, timeout=config.request_timeout_s, options=_CHANNEL_OPTIONS)

    async def call(self, request: Awaitable[T]) -> T:
        async with asyncio.timeout(self.config.request_timeout_s):
            return await request

    async def close(self) -> None:
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                await self.client.close()
        except ETCD_ERRORS:
            pass  # the channel is gone either way; nothing to tell anyone
