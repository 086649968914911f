"""A KV server lets go of a peer's session once the peer stayed away past its reconnect window.

MD's KV server beside vLLM never asks for ``links()``, where closed sessions used to be dropped;
each link a reconnecting P left stayed in the listener with every transfer it had received (their
receivers: a few KB each). A new connection now drops the closed ones, and a closed session drops
its receivers.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

from pddlink.transport import KVClient, KVServer, LinkOptions, PeerIdentity
from tests.transport.test_tcp_link import begin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
OPTIONS = LinkOptions(
    chunk_bytes=1 << 20,
    window_bytes=8 << 20,
    connect_timeout_s=0.3,
    reconnect_attempts=1,
    reconnect_backoff_s=0.05,
)
GRACE_S = 0.35  # what the server waits for a reconnect: the backoff plus the connect timeout


def test_a_closed_session_is_dropped_when_the_next_link_comes(pki: Any, run_async: Any) -> None:
    async def connect(server: KVServer) -> KVClient:
        return await KVClient.connect(
            "127.0.0.1", server.port, identity=CLIENT, tls=pki[CLIENT], expected_peer=SERVER, options=OPTIONS
        )

    async def scenario() -> tuple[bool, int]:
        got: list[Any] = []
        server = await KVServer.start(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], options=OPTIONS, on_transfer=got.append
        )
        try:
            client = await connect(server)
            for tid in range(1, 6):
                await client.send_transfer(begin(tid, 300_000), bytes(300_000), deadline_s=10.0)
            (first,) = server.links()
            session = weakref.ref(first)
            del first
            await client.close()
            await asyncio.sleep(GRACE_S + 0.5)  # the peer stayed away: its session closes
            client = await connect(server)  # a new link, never a call to links()
            await client.send_transfer(begin(6, 300_000), bytes(300_000), deadline_s=10.0)
            got.clear()
            gc.collect()
            alive, links = session() is not None, len(server.links())
            await client.close()
            return alive, links
        finally:
            await server.close()

    alive, links = run_async(scenario)
    assert not alive
    assert links == 1
