"""A connection given up is reset, not closed (``FrameConnection.reset``): the peer sees a TCP
reset, and what was still queued for it is thrown away. P's KV link to MD is dropped this way after
a WAN outage, so the reservations queued on it are never delivered once the WAN is back (TCP
retransmits them for tens of seconds: MD then pinned blocks for requests P had given up, held
after the chaos load ended). Real sockets on loopback; the peer here is a plain socket."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pddlink.transport.framing import FrameConnection


async def _peer_sees(how: str) -> str:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(
        lambda: FrameConnection(lambda c, m: None, lambda c, e: None), "127.0.0.1", port
    )
    peer, _ = await loop.run_in_executor(None, listener.accept)
    conn.reset() if how == "reset" else conn.close()
    await asyncio.sleep(0.1)
    peer.settimeout(2.0)
    try:
        while peer.recv(65536):
            pass
        return "eof"
    except ConnectionResetError:
        return "reset"
    finally:
        peer.close()
        listener.close()


@pytest.mark.parametrize("how", ["reset", "close"])
def test_reset_ends_the_connection_with_a_tcp_reset_close_with_eof(how: str) -> None:
    assert asyncio.run(_peer_sees(how)) == ("reset" if how == "reset" else "eof")
