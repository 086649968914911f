"""``KVServer`` and ``KVClient``: the transport API the sidecar uses, whatever transport runs below.

Both resolve the transport by name through the registry (so QUIC or RDMA load only when chosen)
and delegate to its ``listen`` / ``connect``. See ``pddlink.transport`` for the full contract.

They also apply the KV codec a transfer names (``TransferBegin.codec``, ``pddlink.kv.payload``):
``KVClient.send_transfer`` encodes the payload on a thread pool before the first byte leaves
(``total_bytes`` becomes the encoded size; the result says the codec, the KV bytes before it and
the time spent), ``KVServer`` decodes a verified transfer the same way before its ``on_transfer``
sees it: one chunk of KV, ``begin.total_bytes`` set to its length (``begin.codec`` still names the
codec) and ``ReceivedTransfer.wire_bytes`` keeping what crossed; a payload that does not decode goes
to ``on_transfer_failed`` with code INTEGRITY. RAW transfers pass through untouched, as before.
Transports used directly (``listen``/``connect``) move the payload as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import threading
import time
from collections.abc import Awaitable, Sequence

from pddlink.errors import ErrorCode, InvalidInput, LocalError, PddlinkError
from pddlink.kv.codec import CodecId, ParallelCodec
from pddlink.kv.payload import decode_payload, encode_payload
from pddlink.transfer.config import TransferManifest
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
    ReceivedTransfer,
    TransferResult,
)
from pddlink.transport.tls import PeerIdentity, TlsConfig
from pddlink.wire import TransferBegin

log = logging.getLogger(__name__)
CODEC_THREADS = max(1, min(4, os.cpu_count() or 1))  # one pool per process, shared by every link
_pool: ParallelCodec | None = None
_pool_lock = threading.Lock()


def codec_pool() -> ParallelCodec:
    """The process's KV codec threads (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ParallelCodec(CODEC_THREADS)
        return _pool


def _codec_of(begin: Message) -> CodecId:
    return CodecId(getattr(begin, "codec", CodecId.RAW))


def _decoding(handlers: Handlers) -> Handlers:
    """``handlers`` with ``on_transfer`` seeing decoded KV (RAW transfers are handed on as they are)."""
    on_transfer, on_failed = handlers.on_transfer, handlers.on_transfer_failed
    if on_transfer is None:
        return handlers

    async def decode(received: ReceivedTransfer) -> None:
        begin = received.begin
        t0 = time.perf_counter()
        try:
            data = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: decode_payload(
                    received.chunks, _codec_of(begin), begin.layout.dtype, pool=codec_pool()
                ),
            )
        except PddlinkError as exc:
            received.release()
            log.warning(
                "transfer %d from %s does not decode: %s", begin.transfer_id, received.peer, exc.message
            )
            if on_failed is not None:
                error = LocalError(f"KV payload does not decode: {exc.message}", code=ErrorCode.INTEGRITY)
                result = on_failed(received.peer, begin, error)
                if inspect.isawaitable(result):
                    await result
            return
        wire_bytes = received.bytes
        received.release()  # the decoded copy is all that is viewed from here on
        decoded = dataclasses.replace(
            received,
            begin=dataclasses.replace(begin, total_bytes=len(data)),  # what the consumer holds now
            chunks=[data],
            seconds=received.seconds + time.perf_counter() - t0,
            wire_bytes=wire_bytes,
        )
        result = on_transfer(decoded)
        if inspect.isawaitable(result):
            await result

    def deliver(received: ReceivedTransfer) -> Awaitable[None] | None:
        if _codec_of(received.begin) is CodecId.RAW:
            return on_transfer(received)
        return decode(received)

    return dataclasses.replace(handlers, on_transfer=deliver)


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
        handlers = _decoding(Handlers(on_transfer, on_message, on_transfer_failed))
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
        codec = _codec_of(begin)
        if codec is CodecId.RAW:
            return await self._link.send_transfer(begin, payload, deadline_s=deadline_s)
        data = as_view(payload)
        t0 = time.perf_counter()
        wire = await asyncio.get_running_loop().run_in_executor(
            None, encode_payload, data, begin.layout.dtype, codec, codec_pool()
        )
        codec_s = time.perf_counter() - t0
        if isinstance(begin, TransferBegin):
            begin = dataclasses.replace(begin, total_bytes=len(wire))
        elif not isinstance(begin, TransferManifest):
            raise InvalidInput(
                f"send_transfer takes a TransferBegin or TransferManifest, not {type(begin).__name__}"
            )
        result = await self._link.send_transfer(begin, wire, deadline_s=max(deadline_s - codec_s, 0.001))
        return dataclasses.replace(result, codec=codec, raw_bytes=len(data), codec_seconds=codec_s)

    async def send_message(self, message: Message) -> None:
        await self._link.send_message(message)

    async def request(self, message: Message, *, timeout_s: float) -> Message:
        return await self._link.request(message, timeout_s=timeout_s)

    def stats(self) -> LinkStats:
        return self._link.stats()

    @property
    def usable(self) -> bool:
        """False once the link is closed or gave up reconnecting (dial a new client then)."""
        return self._link.usable

    async def close(self, *, reset: bool = False) -> None:
        """``reset``: a link given up (silent, stalled): its connections are reset where the
        transport can (TCP), so requests still queued in the kernel never reach the peer."""
        hard = getattr(self._link, "reset", None) if reset else None
        await (hard() if hard is not None else self._link.close())

    async def __aenter__(self) -> KVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def as_view(payload: Buffer | Sequence[Buffer]) -> memoryview:
    if isinstance(payload, bytes | bytearray | memoryview):
        return memoryview(payload).cast("B")
    return memoryview(b"".join(payload))
