"""A TLS connection keeps no copy of what waited for a congested line once it has gone out.

asyncio's (and uvloop's) TLS transport encrypts whatever it is given at once into OpenSSL's
outgoing memory BIO, also while the socket beneath it is paused, and that buffer never shrinks:
it keeps the largest backlog the connection ever had for as long as the connection lives. A P
that wrote every frame of a congested WAN into it kept tens of MiB per link after a burst (issue
16, chaos: 45 -> 105 MiB of live mapped memory in a quiet P, no Python object more). Frames now
wait in ``FrameConnection``'s own queue, as references to the caller's buffers, and go to the TLS
transport in pieces under a low mark (``pddlink.transport.framing``).

Real loopback sockets, TLS 1.3 both ways, through ``TcpRelay``, which stops reading for a while
(the line is congested): every transfer arrives whole; afterwards, with every payload gone, the
process holds no more of malloc's memory than a few connection buffers (glibc's figures).
"""

from __future__ import annotations

import asyncio
import gc
import random
from typing import Any

import pytest

from pddlink.serving.malloc_trim import fix_mmap_threshold, heap_stats
from pddlink.transport import KVClient, KVServer, LinkOptions, ReceivedTransfer
from tests.transport.conftest import CLIENT, SERVER
from tests.transport.test_tcp_link import begin

pytestmark = pytest.mark.timeout(60)

TRANSFERS, SIZE = 6, 8 << 20  # 48 MiB queued behind the stalled line at once
OPTIONS = LinkOptions(chunk_bytes=1 << 20, window_bytes=8 << 20)
KEPT_BOUND = 12 << 20  # connection buffers (TLS, frames), not the backlog


def mapped() -> int:
    """malloc's live bytes: blocks mapped on their own and those in its arenas (a large block
    comes from an arena when a free chunk there fits it, whatever the mmap threshold)."""
    gc.collect()
    stats = heap_stats()
    return int(stats["malloc_mapped"]) + int(stats["malloc_in_use"])


def test_a_backlog_behind_a_stalled_line_is_not_kept_after_it_drains(
    pki: Any, run_async: Any, relay_factory: Any
) -> None:
    assert fix_mmap_threshold()  # as in every sidecar: large blocks are mappings of their own
    digests: list[int] = []

    async def scenario() -> tuple[list[int], int, int]:
        got: list[int] = []

        def on_transfer(r: ReceivedTransfer) -> None:
            got.append(hash(b"".join(bytes(c) for c in r.chunks)))

        server = await KVServer.start(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], on_transfer=on_transfer, options=OPTIONS
        )
        relay = relay_factory(server.port)
        port = await relay.start()
        client = await KVClient.connect(
            "127.0.0.1", port, identity=CLIENT, tls=pki[CLIENT], streams=1, options=OPTIONS
        )
        try:
            before = mapped()
            payloads = [random.Random(i).randbytes(SIZE) for i in range(TRANSFERS)]
            digests.extend(hash(p) for p in payloads)
            relay.running.clear()  # the line stops: the sender's socket fills, its transport pauses
            sends = [
                asyncio.ensure_future(client.send_transfer(begin(i + 1, SIZE), p, deadline_s=30.0))
                for i, p in enumerate(payloads)
            ]
            await asyncio.sleep(1.0)
            relay.running.set()
            await asyncio.gather(*sends)
            del sends, payloads
            await asyncio.sleep(0.2)
            return got, before, mapped()
        finally:
            await client.close()
            await relay.close()
            await server.close()

    got, before, after = run_async(scenario)
    assert sorted(got) == sorted(digests)
    kept = after - before
    assert kept < KEPT_BOUND, f"{kept / 2**20:.1f} MiB still mapped with the link open and idle"
