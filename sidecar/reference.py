"""The role logic beside an engine the sidecar drives (``engine = "reference"``; the program is
``sidecar.daemon``): P's prefiller with its WAN pools and fast paths, RLD's and MD's decoder, the
KV transport server (RLD, MD), MD's DRC answering P's reservations, P's DRC telling routers what its
prefix cache holds (``DrcEvents``, as MD's does: placement prefers the P that holds a prompt), and
the gRPC Sidecar service
(TLS 1.3, mutual, when ``tls_dir`` is set: see ``pddlink.serving.grpc_tls``), all over one
``AdapterBridge`` (the engine and the loop its calls go through; ``engines_adapter.adapter_bridge``).

Lifecycle (called by the daemon): ``start(ready)`` builds the role, starts the sweeper, the KV
server, P's links and the gRPC service, and fills the READY line's ports; ``announce(ready)`` once
the admin port serves: the membership (``[membership]``) and the dial of the decoders P and RLD
hand tokens to; ``stop()`` drains (announced ``draining``; the requests it holds end, within
``DRAIN_BOUND_S``) unless the engine is gone, leaves the membership, and closes listeners and peers
in that order (the bridge is the daemon's to close). ``failure()``: why the engine went, when it
did (the daemon then exits non-zero, for its supervisor to restart it).

Engine: ``engine.mode = "thread"`` runs it in a worker thread of this process; ``"process"`` starts
``pddlink engine`` as a child that attaches over the engine link (``sidecar.engine_process``) before
anything else starts, and is stopped after everything else; the role logic sees the same
``EngineAdapter`` either way (``RemoteEngine``), driven by the same ``EngineLoop``.

Admin endpoints of its own (the daemon serves the common ones): /drc/stats (JSON), /drc/snapshot
(bytes), POST /drc/match, on MD and P.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cryptography import x509

from engines_adapter import EngineAdapter, load_engine
from engines_adapter.adapter_bridge import AdapterBridge
from pddlink import metrics
from pddlink.drc.inspect import match_json, stats_json
from pddlink.drc.reservations import ReservationIds
from pddlink.errors import InvalidInput, PddlinkError
from pddlink.roles import DECODER_ROLES, Role
from pddlink.routing import RoutingPolicy
from pddlink.serving.grpc_tls import SIDECAR_CALLERS, CallerCheck, bind, new_server
from pddlink.serving.http import Request, Response, error_response, json_response
from pddlink.serving.rpc import stubs
from pddlink.transport import (
    KVServer,
    LinkOptions,
    PeerIdentity,
    ReceivedTransfer,
    TlsConfig,
    choose_fast_path,
    load_node,
)
from pddlink.transport.tls import identity_from_certificate
from pddlink.wire import Release, Reserve, ReserveAnswer
from sidecar.config import SidecarConfig
from sidecar.decoder import Decoder
from sidecar.kv_admission import KvAdmission
from sidecar.membership import SidecarMembership
from sidecar.peers import DecoderPeer, KVPeer, KVPeerPool
from sidecar.prefill import Prefiller
from sidecar.service import SidecarService
from sidecar.sweep import Sweeper
from sidecar.wan_codec import WanCodec
from sidecar.wan_silence import SILENCE_MIN_S

ENGINE_DEAD_LINGER_S = 1.0  # streams end with their typed reason before the sidecar goes
DIAL_DECODERS_S = 60.0  # the decoders P and RLD hand tokens to: dialled at start, waited for this long
DRAIN_BOUND_S = 30.0  # SIGTERM: what runs here may take this long to end (a request's default deadline)


def build_engine(cfg: SidecarConfig) -> EngineAdapter:
    import torch

    torch.set_num_threads(1)  # three engines share two cores in the demo; see engines_adapter docs
    e = cfg.engine
    return load_engine(
        e.name, preset=e.preset, dtype=e.dtype, block_size=e.block_size, num_blocks=e.num_blocks, seed=e.seed,
        **({"prefill_slowdown": e.prefill_slowdown} if e.prefill_slowdown > 1 else {}),
    )  # fmt: skip


def _md_decoder(addr: str, tls: TlsConfig | None, who: PeerIdentity) -> DecoderPeer:
    """An MD's Sidecar service across the WAN: a handoff to it ends once MD has been silent for
    the bound (``sidecar.wan_silence.CallSilence``), as a shipment to it does."""
    return DecoderPeer(addr, tls=tls, expected=who, silence_floor_s=SILENCE_MIN_S)


def _handoff_sender(md: DecoderPeer) -> Callable[[bytes, float], Awaitable[int]]:
    async def send(frame: bytes, timeout_s: float) -> int:
        return await md.handoff(frame, timeout_s=timeout_s)

    return send


def adapter_bridge(cfg: SidecarConfig, engine: EngineAdapter | None = None) -> AdapterBridge:
    """The bridge to this sidecar's engine (built here unless given: a child process's); on MD
    with the engine's prefix cache as a DRC of three quarters of its pool (the rest holds what P's
    reservations pin and what MD decodes); on P as a DRC of all of it (nothing is pinned there: the
    pool's own LRU evicts, and the DRC forgets what it evicted), which routers mirror."""
    blocks = cfg.engine.num_blocks
    drc_blocks = {Role.MD.value: blocks * 3 // 4, Role.P.value: blocks}.get(cfg.role)
    return AdapterBridge(
        engine if engine is not None else build_engine(cfg), cfg.decode.max_batch, drc_blocks
    )


class ReferenceSidecar:
    def __init__(self, cfg: SidecarConfig, bridge: AdapterBridge) -> None:
        self.cfg = cfg
        self.identity = PeerIdentity(cfg.role, cfg.name)
        self.tls: TlsConfig | None = load_node(Path(cfg.tls_dir), self.identity) if cfg.tls_dir else None
        self.bridge = bridge
        self.engine, self.loop, self.drc = bridge.engine, bridge.loop, bridge.drc
        self.server: Any = None  # the gRPC server
        self.dial: asyncio.Task[None] | None = None
        self.reservations = ReservationIds()  # wire reservation ids of the DRC's leases (MD)
        self.decoder: Decoder | None = None
        self.admission: KvAdmission | None = None  # RLD books KV blocks per Attach (sidecar.kv_admission)
        self.prefiller: Prefiller | None = None
        self.kv_server: KVServer | None = None
        self.peers: list[Any] = []
        self.fast_path = choose_fast_path() if cfg.data_plane.fast_transport == "auto" else None
        self.caller_check: CallerCheck | None = None
        self.sweeper: Sweeper | None = None
        self._stop: asyncio.Event | None = None
        self.membership: SidecarMembership | None = None  # [membership]: announced in etcd

    def _options(self, wan: bool) -> LinkOptions:
        dp = self.cfg.data_plane
        return LinkOptions(streams=dp.wan_streams if wan else 1, chunk_bytes=dp.chunk_bytes)

    def _fast_transport(self) -> str:
        if self.fast_path is not None:
            metrics.set_fast_path(self.fast_path.name, self.fast_path.reason)
            return self.fast_path.name
        metrics.set_fast_path(self.cfg.data_plane.fast_transport, "configured")
        return self.cfg.data_plane.fast_transport

    def _build_role(self) -> None:
        cfg = self.cfg
        role = Role(cfg.role)
        if role in DECODER_ROLES:
            self._build_decoder(role)
        if role is Role.P:
            self._build_prefiller()

    def _build_decoder(self, role: Role) -> None:
        """RLD and MD: the decoder; RLD also its KV admission and the MDs it hands requests over to."""
        cfg, peers = self.cfg, self.cfg.peers
        policy = RoutingPolicy(
            catch_up_below_load=cfg.decode.catch_up_below_load, catch_up_slice_tokens=cfg.decode.slice_tokens
        )
        send = None
        send_to: dict[str, Callable[[bytes, float], Awaitable[int]]] = {}
        if role is Role.RLD:
            self.admission = KvAdmission(cfg.engine.num_blocks, cfg.engine.block_size)
            fleet_mds = self._fleet_peers(Role.MD)
            md_by_id = {i: _md_decoder(g, self.tls, i) for i, g, _ in fleet_mds}
            if peers.md_grpc:
                md_by_id[peers.md] = _md_decoder(peers.md_grpc, self.tls, peers.md)
            self.peers += list(md_by_id.values())
            send_to = {i.common_name: _handoff_sender(md) for i, md in md_by_id.items()}
            default = send_to.get(peers.md.common_name) if peers.md_grpc else None
            send = default or next(iter(send_to.values()), None)
        self.decoder = Decoder(
            cfg.role,
            self.loop,
            drc=self.drc,
            capacity=cfg.decode.capacity,
            policy=policy,
            send_handoff=send,
            send_handoff_to=send_to if role is Role.RLD else None,
        )

    def _build_prefiller(self) -> None:
        """P: the routes to every MD (WAN pool) and RLD (fast path) it may ship to, and the prefiller."""
        cfg, peers = self.cfg, self.cfg.peers
        mds, rlds = self._fleet_peers(Role.MD), self._fleet_peers(Role.RLD)
        md_routes = {i.common_name: self._md_route(g, kv, i) for i, g, kv in mds}
        rld_routes = {i.common_name: self._rld_route(g, kv, i) for i, g, kv in rlds}
        if peers.md_grpc and peers.md_kv:
            md_routes[peers.md.common_name] = self._md_route(peers.md_grpc, peers.md_kv, peers.md)
        if peers.rld_kv and peers.rld_grpc:
            rld_routes[peers.rld.common_name] = self._rld_route(peers.rld_grpc, peers.rld_kv, peers.rld)
        md_kv, md = md_routes[peers.md.common_name] if peers.md_kv else next(iter(md_routes.values()))
        no_rld: tuple[KVPeer | None, DecoderPeer | None] = (None, None)
        rld_kv, rld = rld_routes.get(peers.rld.common_name, no_rld) if peers.rld_kv else no_rld
        for pool, dec in md_routes.values():
            self.peers += [*pool.links, dec]
        self.peers += [p for route in rld_routes.values() for p in route]
        self.prefiller = Prefiller(
            self.loop,
            md_kv=md_kv,
            md=md,
            rld_kv=rld_kv,
            rld=rld,
            chunk_bytes=cfg.data_plane.chunk_bytes,
            lease_s=cfg.data_plane.reserve_lease_s,
            wan_codec=WanCodec(
                cfg.data_plane.wan_codec,
                line_mbit=cfg.data_plane.wan_line_mbit,
                pool_size=cfg.data_plane.wan_links,
            ),
            md_routes=md_routes,
            rld_routes=rld_routes,
            drc=self.drc,
        )

    def _fleet_peers(self, role: Role) -> list[tuple[PeerIdentity, str, str]]:
        """(identity, gRPC address, KV address) of each ``role`` instance of ``peers.topology``
        that has a KV address (a peer this sidecar may be told to ship to or hand over to)."""
        fleet = self.cfg.peers.fleet()
        if fleet is None:
            return []
        return [
            (PeerIdentity.parse(m.instance.identity), m.instance.address, m.instance.kv_address)
            for m in fleet.members(role)
            if m.instance.kv_address and m.instance.address
        ]

    def busy(self) -> int:
        """Requests this sidecar holds now: prefills (P), sequences being decoded (RLD, MD)."""
        held = self.prefiller.in_flight if self.prefiller is not None else 0
        if self.decoder is not None:
            held += int(self.decoder.status()["requests"])
        return held

    async def drain(self, bound_s: float) -> None:
        """SIGTERM: announce ``draining`` (membership: routers place nothing new here), then let
        what runs here end, within ``bound_s``; the listeners stay up meanwhile."""
        if self.membership is not None:
            await self.membership.draining()
        loop = asyncio.get_running_loop()
        until = loop.time() + bound_s
        while self.busy() and loop.time() < until:
            await asyncio.sleep(0.05)
        if self.busy():
            sys.stderr.write(f"sidecar: stopping with {self.busy()} request(s) held after {bound_s:.0f} s\n")

    def add_peer(self, who: PeerIdentity, grpc_addr: str, kv_addr: str, *, moved: bool = False) -> bool:
        """A peer that announced itself (``sidecar.membership``) becomes one by identity, as the
        topology file's are: P ships to an MD and relays through an RLD, RLD hands over to an MD.
        ``moved``: it announced new addresses (a restart elsewhere): the new ones replace the old.
        False when this sidecar has no use for it or knows it already."""
        name, role = who.common_name, Role(who.role)
        if moved and self.prefiller is not None:
            self.prefiller.md_routes.pop(name, None)
            self.prefiller.rld_routes.pop(name, None)
        if moved and self.decoder is not None and self.cfg.role == "rld":
            self.decoder.relay.send_to.pop(name, None)
        if self.prefiller is not None and role is Role.MD and name not in self.prefiller.md_routes:
            pool, dec = self.prefiller.md_routes[name] = self._md_route(grpc_addr, kv_addr, who)
            self.peers += [*pool.links, dec]
            return True
        if self.prefiller is not None and role is Role.RLD and name not in self.prefiller.rld_routes:
            kv, dec = self.prefiller.rld_routes[name] = self._rld_route(grpc_addr, kv_addr, who)
            self.peers += [kv, dec]
            return True
        relay = self.decoder.relay if self.decoder is not None and self.cfg.role == "rld" else None
        if relay is not None and role is Role.MD and name not in relay.send_to:
            md = _md_decoder(grpc_addr, self.tls, who)
            relay.send_to[name] = _handoff_sender(md)
            self.peers.append(md)
            return True
        return False

    def _md_route(self, grpc_addr: str, kv_addr: str, who: PeerIdentity) -> tuple[KVPeerPool, DecoderPeer]:
        """An MD's WAN connection pool (``wan_links`` links) and its Sidecar service."""
        links = [
            KVPeer(
                kv_addr,
                identity=self.identity,
                tls=self.tls,
                transport=self.cfg.data_plane.wan_transport,
                options=self._options(wan=True),
                expected_peer=who if self.tls else None,
                silence_floor_s=SILENCE_MIN_S,  # an outage ends the shipment at once
            )
            for _ in range(self.cfg.data_plane.wan_links)
        ]
        return KVPeerPool(links), _md_decoder(grpc_addr, self.tls, who)

    def _rld_route(self, grpc_addr: str, kv_addr: str, who: PeerIdentity) -> tuple[KVPeer, DecoderPeer]:
        """An RLD's fast path and its Sidecar service."""
        kv = KVPeer(
            kv_addr,
            identity=self.identity,
            tls=self.tls,
            transport=self._fast_transport(),
            options=self._options(wan=False),
            expected_peer=who if self.tls else None,
        )
        return kv, DecoderPeer(grpc_addr, tls=self.tls, expected=who)

    async def _dial_decoders(self) -> None:
        """P's and RLD's channels to the decoders they hand tokens to, connected before any
        handoff needs them (``DecoderPeer.connect``); a peer not up yet is waited for a while."""
        decoders = [p for p in self.peers if isinstance(p, DecoderPeer)]
        await asyncio.gather(*(d.connect(DIAL_DECODERS_S) for d in decoders), return_exceptions=True)

    async def _connect_peers(self, prefiller: Prefiller) -> None:
        async def fast(kv: KVPeer) -> None:
            with contextlib.suppress(PddlinkError, OSError):
                await kv.client(time.monotonic() + 10.0)

        await asyncio.gather(
            *(pool.connect_all(timeout_s=10.0) for pool, _ in prefiller.md_routes.values()),
            *(fast(kv) for kv, _ in prefiller.rld_routes.values()),
        )

    # -- the KV server's callbacks (RLD, MD) -----------------------------------------------------

    async def _on_transfer(self, received: ReceivedTransfer) -> None:
        if self.decoder is not None:
            await self.decoder.on_transfer(received)

    async def _on_message(self, peer: PeerIdentity, msg: Any) -> Any:
        if isinstance(msg, Reserve) and self.drc is not None:
            drc = self.drc
            try:
                held, synced = await self.loop.call(
                    "drc", drc.reserve, msg.request_id, list(msg.block_hashes), msg.lease_ms / 1e3
                )
            except PddlinkError as exc:
                return ReserveAnswer(request_id=msg.request_id, code=exc.code, reason=exc.message)
            drc.publish(synced)
            return ReserveAnswer(
                request_id=msg.request_id,
                reservation_id=self.reservations.grant(msg.request_id),
                cached_blocks=held.cached_blocks,
                lease_ms=msg.lease_ms,
            )
        if isinstance(msg, Release) and self.drc is not None:
            request_id = self.reservations.release(msg.reservation_id)
            if request_id is not None:
                await self.loop.call("drc", self.drc.release, request_id)
        return None

    async def _on_transfer_failed(self, peer: PeerIdentity, begin: Any, exc: PddlinkError) -> None:
        metrics.TRANSFER_ABORTS.labels(reason=exc.code.name.lower()).inc()

    # -- admin ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self.bridge.status()  # the engine side: engine_active, kv bytes a token
        if self.fast_path is not None:
            out["fast_path"] = {"kind": self.fast_path.name, "reason": self.fast_path.reason}
        if self.membership is not None:
            out["membership"] = self.membership.status()
        if self.decoder is not None:
            out["pipelines"] = self.decoder.status()
        if self.admission is not None:
            out["kv_admission"] = self.admission.status()
        if self.prefiller is not None:
            out["transfers"] = {
                "in_flight": self.prefiller.in_flight,
                "in_engine": len(self.prefiller.in_engine),  # prefilled, not yet released
                "wan": self.prefiller.wan_book.to_json(),
            }
            out["wan_codec"] = self.prefiller.wan_codec.status_json(time.monotonic())
            out["links"] = [p.stats() for p in self.peers if isinstance(p, KVPeer)]
        out["grpc_tls"] = self.caller_check.status() if self.caller_check is not None else None
        if self.sweeper is not None:
            out["state"] = self.sweeper.status()
        if self.drc is not None:
            out["drc"] = stats_json(self.drc.index, top=3, block_size=self.engine.layout.block_size)
        return out

    async def admin(self, req: Request) -> Response | None:
        """This role's own endpoints (the daemon serves the common ones); None: not one of them."""
        return await self._drc_admin(req) if req.path.startswith("/drc/") else None

    async def _drc_admin(self, req: Request) -> Response:
        drc = self.drc
        if drc is None:
            return error_response(404, f"role {self.cfg.role} holds no DRC (ask MD)")
        if req.method == "GET" and req.path == "/drc/stats":
            return json_response(
                200, await self.loop.call("drc", stats_json, drc.index, block_size=drc.hasher.block_size)
            )
        if req.method == "GET" and req.path == "/drc/snapshot":
            return Response(200, await self.loop.call("drc", drc.snapshot), "application/octet-stream")
        if req.method == "POST" and req.path == "/drc/match":
            try:
                body = json.loads(req.body or b"null")
                return json_response(
                    200, await self.loop.call("drc", match_json, drc.index, drc.hasher, body)
                )
            except (ValueError, InvalidInput) as exc:
                return error_response(400, str(exc))
        return error_response(404, f"no such endpoint: {req.method} {req.path}")

    def health(self) -> str:
        """Why the engine is gone ("" while it serves): what the sweeper saw, else the bridge."""
        if self.sweeper is not None and self.sweeper.engine_dead:
            return self.sweeper.engine_dead
        return self.bridge.health()

    def failure(self) -> str:
        """Why this sidecar stops on its own ("" when it was asked to): its engine died."""
        return self.sweeper.engine_dead if self.sweeper is not None else ""

    def _on_engine_dead(self, why: str) -> None:
        sys.stderr.write(f"sidecar: {why}: not ready; stopping so the supervisor restarts this sidecar\n")
        if self._stop is not None:
            asyncio.get_running_loop().call_later(ENGINE_DEAD_LINGER_S, self._stop.set)

    def _certificate_identity(self) -> str:
        """The identity this sidecar's certificate names (what peers verify), "" without TLS."""
        if self.tls is None:
            return ""
        cert = x509.load_pem_x509_certificate(Path(self.tls.cert_file).read_bytes())
        return str(identity_from_certificate(cert))

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, ready: dict[str, Any], stop: asyncio.Event) -> None:
        """Everything but the admin port up; the READY line's ports into ``ready``. ``stop`` is
        set when the engine dies (the daemon then stops, for its supervisor to restart it)."""
        self._stop = stop
        self.bridge.start()
        self._build_role()
        self.sweeper = Sweeper(
            decoder=self.decoder,
            drc=self.drc,
            run_in_engine=self.loop.call,
            engine=self.engine,
            on_engine_dead=self._on_engine_dead,
        )
        self.sweeper.start()
        if Role(self.cfg.role) in DECODER_ROLES:
            ready["kv_port"] = await self._start_kv_server()
        if self.prefiller is not None:  # open the WAN pools and the fast paths before traffic arrives
            await self._connect_peers(self.prefiller)
        self.server = await self._start_grpc(ready)

    def announce(self, ready: dict[str, Any]) -> None:
        """Once the admin port serves: the decoders dialled, the membership announced (the router
        may place here from then on)."""
        self.dial = asyncio.get_running_loop().create_task(self._dial_decoders())
        if self.cfg.membership.enabled:
            self.membership = SidecarMembership(self)
            self.membership.start(ready)

    async def stop(self) -> None:
        """Drain (unless the engine is gone), then leave the membership and close what listens."""
        if not self.health():
            await self.drain(DRAIN_BOUND_S)
        if self.dial is not None:
            self.dial.cancel()
        await self._shut_down()

    async def _start_kv_server(self) -> int:
        """RLD and MD: the KV data plane (MD's across the WAN, RLD's the fast path); its port."""
        cfg = self.cfg
        wan = Role(cfg.role) is Role.MD
        transport = cfg.data_plane.wan_transport if wan else self._fast_transport()
        self.kv_server = await KVServer.start(
            cfg.host,
            cfg.kv_port,
            identity=self.identity,
            tls=self.tls,
            transport=transport,
            on_transfer=self._on_transfer,
            on_message=self._on_message,
            on_transfer_failed=self._on_transfer_failed,
            options=self._options(wan=wan),
        )
        return self.kv_server.port

    async def _start_grpc(self, ports: dict[str, Any]) -> Any:
        """The Sidecar gRPC service (mTLS unless plaintext was asked for); its port into ``ports``."""
        cfg = self.cfg
        _, pb2_grpc = stubs()
        server, self.caller_check = new_server(
            self.tls, callers=SIDECAR_CALLERS, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        service = SidecarService(
            role=cfg.role,
            peer_id=cfg.name,
            model_id=self.engine.layout.model_id,
            tls_identity=self._certificate_identity(),
            status=self.status,
            prefiller=self.prefiller,
            decoder=self.decoder,
            drc=self.drc,
            run_in_engine=self.loop.call,
            admission=self.admission,
            wan_book=self.prefiller.wan_book if self.prefiller is not None else None,
        )
        pb2_grpc.add_SidecarServicer_to_server(service, server)
        ports["grpc_port"] = bind(server, f"{cfg.host}:{cfg.grpc_port}", self.tls)
        ports["tls_identity"] = service.tls_identity
        if self.tls is None:
            sys.stderr.write("sidecar: plaintext gRPC and KV data plane (tls_dir ''): tests and labs only\n")
        await server.start()
        return server

    async def _shut_down(self) -> None:
        """Leaves the membership first (routers stop placing here at once), then closes every
        listener and peer, each within a bound (the bridge, the engine loop, is the daemon's)."""
        if self.membership is not None:
            await self.membership.close()
        if self.sweeper is not None:
            await self.sweeper.close()
        if self.prefiller is not None:
            self.prefiller.wan_book.close()  # the routers' WatchWan streams end now, not at the grace
        if self.server is not None:
            await self.server.stop(grace=0.5)
        if self.kv_server is not None:
            with contextlib.suppress(TimeoutError, OSError, PddlinkError):
                await asyncio.wait_for(self.kv_server.close(), 2.0)
        for p in self.peers:
            with contextlib.suppress(TimeoutError, OSError, PddlinkError):
                await asyncio.wait_for(p.drop() if isinstance(p, KVPeer) else p.close(), 2.0)
