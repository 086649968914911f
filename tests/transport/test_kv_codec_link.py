"""The KV codec on a real link: KVClient encodes what TransferBegin.codec names, KVServer decodes.

Real loopback TCP with TLS 1.3 on both ends; both codecs; a payload labelled with a codec it was
not encoded in (sent below the facade, as a faulty peer would) is refused with code INTEGRITY.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pddlink.errors import ErrorCode, PddlinkError
from pddlink.kv.codec import CodecId
from pddlink.kv.codec_policy import synthetic_kv
from pddlink.transport import KVClient, KVServer, LinkOptions, PeerIdentity, ReceivedTransfer
from pddlink.wire import KVLayoutSpec, TransferBegin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
LAYOUT = KVLayoutSpec("test/model", 2, 2, 64, "bfloat16", 32)
OPTIONS = LinkOptions(chunk_bytes=256 << 10, window_bytes=8 << 20)
KV = synthetic_kv("bfloat16", (3 << 20) + 8192, seed=7)


def begin(transfer_id: int, codec: CodecId, size: int) -> TransferBegin:
    return TransferBegin(
        transfer_id, 0, f"req-{transfer_id}", LAYOUT, 0, 32, (transfer_id,), codec, size, 256 << 10, 10_000
    )


async def pair(pki: dict[PeerIdentity, Any], **handlers: Any) -> tuple[KVServer, KVClient]:
    server = await KVServer.start(
        "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], options=OPTIONS, **handlers
    )
    client = await KVClient.connect(
        "127.0.0.1", server.port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER, options=OPTIONS
    )
    return server, client


@pytest.mark.parametrize("codec", [CodecId.RAW, CodecId.PLANES_ZSTD])
def test_kv_crosses_a_real_link_in_either_codec_and_arrives_byte_for_byte(
    pki: Any, run_async: Any, codec: CodecId
) -> None:
    async def scenario() -> tuple[Any, ReceivedTransfer]:
        arrived: asyncio.Future[ReceivedTransfer] = asyncio.get_running_loop().create_future()
        server, client = await pair(pki, on_transfer=arrived.set_result)
        try:
            result = await client.send_transfer(begin(1, codec, len(KV)), KV, deadline_s=10.0)
            return result, await asyncio.wait_for(arrived, 10.0)
        finally:
            await client.close()
            await server.close()

    result, received = run_async(scenario)
    assert b"".join(bytes(c) for c in received.chunks) == KV
    assert received.codec is codec and received.begin.codec is codec
    assert result.codec is codec and result.kv_bytes == len(KV)
    if codec is CodecId.RAW:
        assert result.bytes == len(KV) and received.wire_bytes is None
    else:
        assert received.wire_bytes == result.bytes < len(KV)
        assert received.begin.total_bytes == len(KV)  # the begin as delivered describes the KV held
        assert len(KV) / result.bytes > 1.3  # Gaussian bf16: the exponent plane halves
        assert result.codec_seconds > 0


def test_a_payload_that_does_not_decode_fails_with_integrity(pki: Any, run_async: Any) -> None:
    async def scenario() -> tuple[list[Any], PddlinkError]:
        got: list[Any] = []
        failed: asyncio.Future[PddlinkError] = asyncio.get_running_loop().create_future()
        server, client = await pair(
            pki, on_transfer=got.append, on_transfer_failed=lambda peer, b, exc: failed.set_result(exc)
        )
        try:
            raw = KV[: 1 << 20]  # raw bytes, labelled as codec frames: bypass the facade's encoder
            await client._link.send_transfer(begin(2, CodecId.PLANES_ZSTD, len(raw)), raw, deadline_s=10.0)
            return got, await asyncio.wait_for(failed, 10.0)
        finally:
            await client.close()
            await server.close()

    got, error = run_async(scenario)
    assert got == [] and error.code is ErrorCode.INTEGRITY and "does not decode" in error.message
