"""``KVServer`` and ``KVClient``: the transport API the sidecar uses, whatever transport runs below.

Both resolve the transport by name through the registry (so QUIC or RDMA load only when chosen)
and delegate to its ``listen`` / ``connect``. See ``pddlink.transport`` for the full contract.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pddlink.transport import registry
from pddlink.transport.base import (
    Buffer,
    Handlers,
    Link,
    LinkOptions,
    LinkStats,
    Listener,
    Message,
    OnMessage,
    OnTransfer,
    OnTransferFailed,
    TransferResult,
)
from pddlink.transport.tls import PeerIdentity, TlsConfig


class KVServer:
    """The receiving end: accepts links from peers and delivers transfers and control messages."""

    def __init__(self, listener: Listener, transport: str) -> None:
        self._listener = listener
        self.transport = transport

    @classmethod
    async def start(
        cls,
        host: str,
        port: int,
        *,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        on_transfer: OnTransfer | None = None,
        on_message: OnMessage | None = None,
        on_transfer_failed: OnTransferFailed | None = None,
        transport: str = "tcp",
        options: LinkOptions | None = None,
    ) -> KVServer:
        impl = registry.load(transport)
        handlers = Handlers(on_transfer, on_message, on_transfer_failed)
        listener = await impl.listen(
            host, port, identity=identity, tls=tls, handlers=handlers, options=options or LinkOptions()
        )
        return cls(listener, impl.name)

    @property
    def port(self) -> int:
        return self._listener.port

    def links(self) -> Sequence[Link]:
        """Links peers have opened to this server (to send control messages back to them)."""
        return self._listener.links()

    async def close(self) -> None:
        await self._listener.close()


class KVClient:
    """The sending end of a link to one peer."""

    def __init__(self, link: Link, transport: str) -> None:
        self._link = link
        self.transport = transport

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        identity: PeerIdentity,
        tls: TlsConfig | None,
        expected_peer: PeerIdentity | None = None,
        streams: int | None = None,
        on_message: OnMessage | None = None,
        transport: str = "tcp",
        options: LinkOptions | None = None,
    ) -> KVClient:
        opts = options or LinkOptions()
        if streams is not None and streams != opts.streams:
            opts = dataclasses.replace(opts, streams=streams)
        impl = registry.load(transport)
        link = await impl.connect(
            host,
            port,
            identity=identity,
            tls=tls,
            expected_peer=expected_peer,
            handlers=Handlers(on_message=on_message),
            options=opts,
        )
        return cls(link, impl.name)

    @property
    def peer(self) -> PeerIdentity:
        return self._link.peer

    async def send_transfer(
        self, begin: Message, payload: Buffer | Sequence[Buffer], *, deadline_s: float
    ) -> TransferResult:
        return await self._link.send_transfer(begin, payload, deadline_s=deadline_s)

    async def send_message(self, message: Message) -> None:
        await self._link.send_message(message)

    async def request(self, message: Message, *, timeout_s: float) -> Message:
        return await self._link.request(message, timeout_s=timeout_s)

    def stats(self) -> LinkStats:
        return self._link.stats()

    async def close(self) -> None:
        await self._link.close()

    async def __aenter__(self) -> KVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
