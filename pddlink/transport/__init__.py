"""Transport adapters: striped TCP and QUIC for the WAN, RDMA for the datacenter fast path.

The sidecar uses two classes and never a transport module directly::

    from pddlink.transport import KVServer, KVClient, LinkOptions, PeerIdentity, load_or_create_peer

    tls = load_or_create_peer(Path("certs"), PeerIdentity("md", "md0"))     # dev PKI; None = plaintext
    server = await KVServer.start(
        "0.0.0.0", 7450, identity=tls.identity, tls=tls, transport="tcp",   # "tcp" | "quic" | "rdma" | "auto"
        on_transfer=handle_kv,            # (ReceivedTransfer) -> None | awaitable; chunks in order
        on_message=handle_control,        # (peer, wire message) -> reply message | None (awaitable ok)
        on_transfer_failed=handle_abort,  # (peer, TransferBegin | None, PddlinkError) -> None
    )
    client = await KVClient.connect(
        host, 7450, identity=PeerIdentity("p", "p0"), tls=p_tls, transport="tcp",
        expected_peer=PeerIdentity("md", "md0"), streams=4, on_message=handle_control,
    )
    result = await client.send_transfer(begin, payload, deadline_s=5.0)   # -> TransferResult
    await client.send_message(handoff)                                    # control channel, fire and forget
    answer = await client.request(reservation, timeout_s=1.0)             # control channel, one reply
    client.stats(); await client.close(); await server.close()

``begin`` is a ``pddlink.wire`` TransferBegin (request id, generation, block hashes, layout, codec,
total bytes); ``payload`` is one buffer (split into ``LinkOptions.chunk_bytes`` memoryview slices,
no copy) or a sequence of buffers sent as chunks as given (codec frames). ``deadline_s`` is relative
seconds from the call. A transfer ends in a ``TransferResult`` or raises a ``PddlinkError`` with its
``code`` (DEADLINE_EXCEEDED, PEER_UNREACHABLE, AUTH, INTEGRITY, ...); the receiver sees the same
reason through ``on_transfer_failed``. Identity: with TLS both sides present certificates from one
CA; the identity in the peer's certificate must equal what it claims in its hello and, when given,
``expected_peer`` -- else ``AuthError`` before any KV moves.

Modules: ``base`` (the contract: Link, Listener, Transport, LinkOptions, results), ``api`` (the two
facades), ``registry`` (names, lazy import, ``choose_fast_path`` for "auto"), ``tls`` (TLS 1.3
mutual auth and the dev PKI), ``sockopt`` (congestion control, TCP_INFO), ``tcp`` (striped TCP),
``quic`` (aioquic / qh3), ``rdma`` (pyverbs).
"""

from pddlink.transport.api import KVClient, KVServer
from pddlink.transport.base import Handlers, LinkOptions, LinkStats, ReceivedTransfer, TransferResult
from pddlink.transport.registry import FastPathChoice, choose_fast_path
from pddlink.transport.tls import AuthError, PeerIdentity, TlsConfig, load_or_create_peer, load_or_create_pki

__all__ = [
    "AuthError",
    "FastPathChoice",
    "Handlers",
    "KVClient",
    "KVServer",
    "LinkOptions",
    "LinkStats",
    "PeerIdentity",
    "ReceivedTransfer",
    "TlsConfig",
    "TransferResult",
    "choose_fast_path",
    "load_or_create_peer",
    "load_or_create_pki",
]
