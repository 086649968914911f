"""Transport adapters: striped TCP and QUIC for the WAN, RDMA for the datacenter fast path.

The sidecar uses two classes and never a transport module directly::

    from pddlink.transport import KVServer, KVClient, LinkOptions, PeerIdentity, load_node

    tls = load_node(Path("pki/md-md0"), PeerIdentity("md", "md0"))  # node dir (pddlink pki); None: plaintext
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

``begin`` is a ``pddlink.wire`` TransferBegin (its transfer id, request id, layout, block hashes,
codec and chunk size are used; generation and deadline are the link's) or a
``pddlink.transfer.TransferManifest`` (the link numbers the transfer and uses
``LinkOptions.chunk_bytes``). ``payload`` is one buffer, cut into memoryview chunks without a copy
(a sequence of buffers is joined once). ``deadline_s`` is relative seconds from the call. A transfer
ends in a ``TransferResult`` or raises a ``PddlinkError`` whose ``code`` says why
(DEADLINE_EXCEEDED, PEER_UNREACHABLE, AUTH, INTEGRITY, CANCELLED, ...); the receiver sees its side's
reason through ``on_transfer_failed``. ``begin.codec`` (``pddlink.kv.codec.CodecId``) names the
KV codec: ``KVClient`` encodes the payload in it and ``KVServer`` decodes it before ``on_transfer``
(see ``api``). ``ReceivedTransfer.chunks`` are the payload buffers in
order; call ``received.release()`` once nothing views them any more and they are reused (a fresh
MiB buffer costs a thousand page faults). Several transfers may run at once on one link.

Identity: with TLS both sides hold certificates from one CA whose CN / SAN URI name
``role/name``; the identity in the peer's certificate must equal what it claims in its hello and,
when given, ``expected_peer`` -- else ``AuthError`` (code AUTH) before any KV moves. TCP uses TLS
1.3 mutual auth in ``ssl``; QUIC (qh3/aioquic cannot verify client certificates) authenticates the
client on stream 0 with a signature bound to the connection (``quic_auth``). ``tls=None`` is
plaintext TCP for labs; QUIC always needs credentials.

Transports: ``tcp`` (control connection + ``LinkOptions.streams`` striped data connections,
BBR per socket, resume on the remaining stripes when one is cut, background reconnect), ``quic``
(qh3 by default, ``QuicTransport.impl = "aioquic"`` selectable; one stream per transfer),
``rdma`` (a TCP link whose control connection negotiates an RDMA lane: both hellos offer
``rdma/1``, the receiver sends its queue-pair endpoint, the sender answers, chunks then go by RDMA
writes with slot credits; where either side has no device, or set-up misses its deadline, the link
stays on its TCP stripes and says why in the log and ``pddlink_fallbacks``), ``auto`` =
``choose_fast_path()``: RDMA where a device and pyverbs exist, else TCP, with the reason logged and
returned (``FastPathChoice.rdma_available`` is the metric flag).

Modules: ``base`` (the contract: Link, Listener, Transport, LinkOptions, results), ``api`` (the two
facades), ``registry`` (names, lazy import, ``choose_fast_path`` for "auto"), ``tls`` (TLS 1.3
mutual auth and the dev PKI), ``session`` / ``receiving`` (control-channel semantics, the accepting
side), ``transfers`` (driving ``pddlink.transfer`` over lanes), ``machine_timer`` (the one timer of a
machine's driver), ``assembler`` / ``framing`` /
``buffers`` (frames from byte streams, pooled receive buffers), ``tcp_conn`` / ``tcp`` (striped TCP),
``quic`` / ``quic_stream`` / ``quic_server`` / ``quic_auth`` (QUIC), ``sockopt`` (congestion
control, TCP_INFO, buffers), ``rdma`` (pyverbs channel), ``rdma_fastpath`` (drives the sans-I/O
set-up of ``pddlink.wire.rdma_setup``), ``rdma_lanes`` (chunk lanes with slot credits),
``rdma_session`` (the rdma link, listener and transport), ``bench`` (the two processes of
``pddlink bench link``).
"""

from pddlink.transport.api import KVClient, KVServer
from pddlink.transport.base import Handlers, LinkOptions, LinkStats, ReceivedTransfer, TransferResult
from pddlink.transport.pki import load_node, load_or_create_peer, load_or_create_pki
from pddlink.transport.registry import FastPathChoice, choose_fast_path
from pddlink.transport.tls import AuthError, PeerIdentity, TlsConfig

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
    "load_node",
    "load_or_create_peer",
    "load_or_create_pki",
]
