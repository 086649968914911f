"""Stripes paced to a known line rate (``LinkOptions.line_rate_bps``), on real loopback sockets.

Each data stripe of the dialling side must carry ``SO_MAX_PACING_RATE = line / 8 / streams``; the
link configured without a line rate stays unpaced; a paced transfer still arrives whole.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from pddlink.errors import ConfigError
from pddlink.transport import KVClient, KVServer, LinkOptions, PeerIdentity, ReceivedTransfer
from pddlink.transport.sockopt import pacing_rate
from pddlink.wire import KVLayoutSpec, TransferBegin

SERVER = PeerIdentity("md", "md0")
CLIENT = PeerIdentity("p", "p0")
LAYOUT = KVLayoutSpec("test/model", 2, 2, 64, "bf16", 16)
CHUNK = 256 << 10
UNPACED = 2**32 - 1  # the kernel reports "no cap" as ~0 (u32 or u64)
pytestmark = pytest.mark.timeout(60)


def test_line_rate_is_validated_and_split_over_the_stripes() -> None:
    assert LinkOptions(streams=4, line_rate_bps=1e9).stripe_pacing_bytes_per_s == 1e9 / 8 / 4
    assert LinkOptions().stripe_pacing_bytes_per_s == 0.0
    with pytest.raises(ConfigError):
        LinkOptions(line_rate_bps=-1.0)


def stripe_rates(client: KVClient) -> list[int]:
    return [pacing_rate(c.transport.get_extra_info("socket")) for c in client._link.data_connections()]


def test_dialled_stripes_pace_to_their_share_of_the_line(pki: Any, run_async: Any) -> None:
    data = random.Random(3).randbytes(3 << 20)
    paced = LinkOptions(streams=4, chunk_bytes=CHUNK, window_bytes=4 << 20, line_rate_bps=400e6)
    plain = LinkOptions(chunk_bytes=CHUNK, window_bytes=4 << 20)

    async def scenario() -> tuple[list[int], list[int], list[ReceivedTransfer]]:
        got: list[ReceivedTransfer] = []
        server = await KVServer.start(
            "127.0.0.1", 0, identity=SERVER, tls=pki[SERVER], on_transfer=got.append, options=plain
        )
        client = await KVClient.connect(
            "127.0.0.1", server.port, identity=CLIENT, tls=pki[CLIENT], options=paced
        )
        try:
            begin = TransferBegin(1, 0, "req-1", LAYOUT, 0, 16, (), 0, len(data), CHUNK, 20_000)
            await client.send_transfer(begin, data, deadline_s=20.0)
            unpaced = await KVClient.connect(
                "127.0.0.1", server.port, identity=CLIENT, tls=pki[CLIENT], options=plain
            )
            try:
                return stripe_rates(client), stripe_rates(unpaced), got
            finally:
                await unpaced.close()
        finally:
            await client.close()
            await server.close()

    dialled, plain_rates, got = run_async(scenario)
    assert dialled == [int(400e6 / 8 / 4)] * 4
    assert plain_rates and all(rate >= UNPACED for rate in plain_rates)
    assert len(got) == 1 and b"".join(bytes(c) for c in got[0].chunks) == data
