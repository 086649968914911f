"""The receive-buffer pool keeps what was out at once, not every payload size it ever saw.

Compressed chunks and a transfer's last chunk have sizes of their own; a pool keyed by exact size
kept one buffer for each (chaos, vLLM: a quiet MD held 60 MiB more than after its warm-up). In
memory first (size classes, the pool alone), then over a real TLS link with the WAN codec, as P
sends MD its KV.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pddlink.kv.codec import CodecId
from pddlink.kv.codec_policy import synthetic_kv
from pddlink.transport import KVClient, KVServer, LinkOptions, PeerIdentity, ReceivedTransfer
from pddlink.transport.buffers import RECEIVE_POOL, BufferPool, size_class
from pddlink.wire import KVLayoutSpec, TransferBegin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
LAYOUT = KVLayoutSpec("test/model", 2, 2, 64, "float32", 16)
KIB = 1 << 10


@given(st.integers(min_value=1, max_value=1 << 40))
def test_a_size_class_holds_the_size_with_at_most_an_eighth_spare(size: int) -> None:
    whole = size_class(size)
    assert size <= whole <= size + size // 8 + 1
    assert size_class(whole) == whole


def test_a_power_of_two_is_a_class_of_its_own() -> None:
    assert [size_class(1 << k) for k in range(12, 28)] == [1 << k for k in range(12, 28)]


def test_distinct_payload_sizes_reuse_a_few_buffers() -> None:
    pool = BufferPool()
    rng = random.Random(3)
    for _ in range(500):  # one at a time, each of a size of its own: 1 buffer a class is enough
        view = pool.acquire(rng.randrange(256 * KIB + 1, (2 << 20) + 1))
        view[-1] = 1  # the view is writable and exactly as long as asked
        pool.release(view.obj)
    classes = 3 * 8  # (256 KiB, 2 MiB] spans three powers of two
    assert pool.allocated <= classes and pool.reused >= 500 - classes
    assert pool.kept_bytes <= classes * (2 << 20)  # an exact-size pool: ~500 buffers, ~550 MiB


def test_a_buffer_not_of_a_class_size_is_not_kept() -> None:
    pool = BufferPool()
    pool.release(bytearray(1_000_003))  # a decoded copy handed back by mistake
    assert pool.kept_bytes == 0


def test_the_bound_holds() -> None:
    pool = BufferPool(max_bytes=3 << 20)
    views = [pool.acquire(1 << 20) for _ in range(5)]
    for view in views:
        pool.release(view.obj)
    assert pool.kept_bytes == 3 << 20


def test_codec_transfers_over_a_real_link_leave_the_pool_at_its_level(pki: Any, run_async: Any) -> None:
    """MD's case: compressed KV of every size, one transfer after another, a reconnect between
    batches. Once a first batch went by, a second one of new sizes adds little to what the pool
    keeps (before the size classes it added every transfer's buffer: all it brought)."""
    rng = random.Random(11)
    options = LinkOptions(chunk_bytes=4 << 20, window_bytes=32 << 20)

    async def batch(server: KVServer, first: int, n: int) -> int:
        """Send ``n`` transfers on a new link; the bytes that crossed."""
        client = await KVClient.connect(
            "127.0.0.1", server.port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER, options=options
        )
        wire = 0
        try:
            for tid in range(first, first + n):
                kv = synthetic_kv("float32", rng.randrange(64, 832) * 2048, seed=tid)
                begin = TransferBegin(
                    tid, 0, f"r{tid}", LAYOUT, 0, len(kv) // 2048, (tid,), CodecId.PLANES_ZSTD, len(kv),
                    4 << 20, 10_000,
                )  # fmt: skip
                wire += (await client.send_transfer(begin, kv, deadline_s=10.0)).bytes
        finally:
            await client.close()
        return wire

    async def scenario() -> tuple[int, int]:
        got: list[ReceivedTransfer] = []

        async def delivered(n: int) -> None:  # KVServer decodes off the loop: the last may lag
            while len(got) < n:
                await asyncio.sleep(0.01)

        server = await KVServer.start(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], options=options, on_transfer=got.append
        )
        try:
            await batch(server, 1, 60)
            await delivered(60)
            level = RECEIVE_POOL.kept_bytes
            wire = await batch(server, 61, 40)
            await delivered(100)
            return wire, RECEIVE_POOL.kept_bytes - level
        finally:
            await server.close()

    wire, added = run_async(scenario)
    assert added < wire / 4
