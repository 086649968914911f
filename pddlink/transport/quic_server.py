"""Starting a QUIC listener, with batched receive for qh3.

The libraries' ``serve`` reads one datagram per callback, and each callback runs the connection's
Python glue (events, timers, transmit). At 8952-byte datagrams that is ~15,000 callbacks per Gbit/s,
which is most of a receiver's CPU. For qh3 we bind the socket ourselves, use qh3's optimized UDP
transport (recvmmsg/GRO, GSO for the acks) and hand every run of datagrams of one connection to
that connection's ``datagrams_received`` in one call. aioquic keeps its own ``serve``.
"""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

from pddlink.transport import sockopt


def _batching_server_class(base: Any) -> Any:
    class BatchingQuicServer(base):  # type: ignore[misc]
        """qh3's ``QuicServer`` taking datagram batches: runs of one known connection go together."""

        def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
            cid_len = self._configuration.connection_id_length
            run: list[bytes] = []
            run_protocol: Any = None
            for data in datagrams:
                protocol = None
                if data and not data[0] & 0x80:  # short header: the destination CID follows at once
                    protocol = self._protocols.get(data[1 : 1 + cid_len])
                if protocol is not None and protocol is run_protocol:
                    run.append(data)
                    continue
                if run:
                    run_protocol.datagrams_received(run, addr)
                    run, run_protocol = [], None
                if protocol is not None and hasattr(protocol, "datagrams_received"):
                    run, run_protocol = [data], protocol
                else:
                    self.datagram_received(data, addr)
            if run:
                run_protocol.datagrams_received(run, addr)

    return BatchingQuicServer


async def serve(mod: SimpleNamespace, host: str, port: int, configuration: Any, create_protocol: Any) -> Any:
    """A listening QUIC server; returns the library's server object."""
    if mod.name != "qh3":
        server = await mod.aio.serve(host, port, configuration=configuration, create_protocol=create_protocol)
        sockopt.size_udp_buffers(server._transport.get_extra_info("socket"))  # the library keeps it private
        return server
    from qh3.asyncio._transport import create_optimized_datagram_transport
    from qh3.asyncio.server import QuicServer

    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sockopt.size_udp_buffers(sock)
    sock.bind(addr)
    server_class = _batching_server_class(QuicServer)

    def create() -> Any:
        return server_class(configuration=configuration, create_protocol=create_protocol)

    _, server = await create_optimized_datagram_transport(loop, create, sock=sock)
    return server
