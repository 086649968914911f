"""The role logic of one sidecar beside one vLLM, over the engine bridge (``engines_adapter.vllm.bridge``:
the shared-memory region, the control channel vLLM's connector dials, the watch on vLLM, the DRC
that vLLM's KV events feed): P: ``ProducerBridge`` + the WAN link to MD and the fast path to RLD;
MD: ``ConsumerBridge`` + the KV server P ships to; RLD: the same consumer bridge and KV server,
fed over the fast path. Each consumer's DRC answers P's reservation with the prefix
its own vLLM holds, so P copies out and ships only the blocks from the smaller of the two (a
conversation's next turn: its new part), where an RLD without a feed answered 0 and got every whole
block of every turn. A consumer with no ``kv_events_endpoint`` answers 0. P's links: MD across the
WAN (``md_addr``, ``transport``) and RLD over the fast path (``rld_addr``, ``rld_transport``: "auto"
picks RDMA where a device is, else TCP, as the reference sidecar does); with pools, one per MD and
RLD of a topology (``md_peers``, ``rld_peers``: by instance name; each request names its own).

Lifecycle: ``await VllmSidecar(cfg).start()`` opens the bridge (the region: ``region_dir``, by
default ``/dev/shm`` where it has room, so the KV copies touch RAM only: in ``<workdir>`` on a disk
the kernel writes every KV byte copied into the mapping back to the disk; see ``shm.region_path``),
on RLD and MD listens for P, and lets the bridge serve ``<workdir>/<name>.sock`` with this role's
handler; when the bridge says its vLLM died, what was held for that engine is reset (``engine_lost``:
in-flight transfers end, slots are freed; the bridge clears the DRC, rebuilt from the next engine's
KV events); ``status()`` is what the admin endpoint and the tests read (held slots and bytes,
transfers in flight, counts); ``close()`` stops vLLM's calls, ends in-flight work, closes listeners
and links, then the bridge (the region and the socket are removed).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines_adapter.vllm.bridge import VllmBridge, VllmEngineSide
from pddlink.connector.shm import ShmRegion
from pddlink.drc import PrefixIndex
from pddlink.errors import ConfigError
from pddlink.listen_policy import check_plaintext_exposure
from pddlink.roles import Role
from pddlink.transport import (
    FastPathChoice,
    KVServer,
    LinkOptions,
    PeerIdentity,
    TlsConfig,
    choose_fast_path,
    load_node,
)
from sidecar.peers import KVPeer
from sidecar.vllm_kv.consumer import ConsumerBridge
from sidecar.vllm_kv.producer import ProducerBridge
from sidecar.wan_codec import WanCodec


@dataclass(frozen=True, slots=True)
class VllmSidecarConfig:
    role: Role
    name: str
    workdir: Path
    model_id: str
    block_size: int
    region_bytes: int = 256 << 20
    region_dir: Path | None = None  # None: /dev/shm where it has room, else workdir
    md_addr: str = ""  # P: MD's KV server, host:port ("" with rld_addr set: P ships to RLD only)
    rld_addr: str = ""  # P: RLD's KV server, host:port (the fast path inside datacenter A)
    # P: a topology's pools, (instance name, KV host:port) each: a request names which it ships to
    md_peers: tuple[tuple[str, str], ...] = ()
    rld_peers: tuple[tuple[str, str], ...] = ()
    rld_transport: str = "auto"  # P: the fast path's transport (auto | tcp | rdma)
    kv_host: str = "127.0.0.1"  # MD: where P ships to
    kv_port: int = 0
    transport: str = "tcp"
    tls_dir: Path | None = None
    options: LinkOptions = field(default_factory=LinkOptions)
    kv_events_endpoint: str = ""  # MD: vLLM's ZMQ publisher (tcp://127.0.0.1:PORT); "" = no feed
    orphan_s: float = 120.0  # MD: a landed transfer nobody loads is freed after this long
    wan_line_mbit: float = 0.0  # P: the WAN line's rate for the codec choice (0 = from measured goodput)
    wan_codec: str = "auto"  # P: auto | raw | planes_zstd
    allow_plaintext_non_loopback: bool = False  # tls_dir None off loopback: said explicitly, or refused

    def __post_init__(self) -> None:
        named = [addr for _, addr in (*self.md_peers, *self.rld_peers)]
        if self.role is Role.P and not (self.md_addr or self.rld_addr or named):
            raise ConfigError("P's vLLM sidecar needs md_addr and/or rld_addr (host:port), or md_peers")
        # the same rule as the reference sidecar's: plaintext KV only where no other host can reach it
        hosts = (
            [a.rpartition(":")[0] for a in (self.md_addr, self.rld_addr, *named) if a]
            if self.role is Role.P
            else [self.kv_host]
        )
        for host in hosts:
            check_plaintext_exposure(
                host,
                tls=self.tls_dir is not None,
                allowed=self.allow_plaintext_non_loopback,
                who="vLLM sidecar",
            )
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")


class VllmSidecar:
    def __init__(self, cfg: VllmSidecarConfig) -> None:
        self.cfg = cfg
        self.bridge = VllmBridge(
            VllmEngineSide(
                name=cfg.name,
                workdir=cfg.workdir,
                model_id=cfg.model_id,
                block_size=cfg.block_size,
                region_bytes=cfg.region_bytes,
                region_dir=cfg.region_dir,
                keeps_prefix_cache=cfg.role is not Role.P,
                kv_events_endpoint=cfg.kv_events_endpoint,
            )
        )
        self.producer: ProducerBridge | None = None
        self.consumer: ConsumerBridge | None = None
        self._kv: KVServer | None = None
        self._md: KVPeer | None = None
        self._rld: KVPeer | None = None
        self._named: dict[str, dict[str, KVPeer]] = {}  # role -> instance name -> peer (pools)
        self.fast_path: FastPathChoice | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def control_path(self) -> Path:
        return self.bridge.control_path

    @property
    def region(self) -> ShmRegion | None:
        return self.bridge.region

    @property
    def kv_port(self) -> int:
        assert self._kv is not None
        return self._kv.port

    def _tls(self, identity: PeerIdentity) -> TlsConfig | None:
        """This node's issued credentials (``pddlink pki issue``); read, never minted."""
        return None if self.cfg.tls_dir is None else load_node(self.cfg.tls_dir, identity)

    async def start(self) -> VllmSidecar:
        try:
            return await self._start()
        except BaseException:
            await self.close()  # the region (in RAM) and the socket do not outlive a failed start
            raise

    async def _start(self) -> VllmSidecar:
        cfg = self.cfg
        region = self.bridge.open()
        identity = PeerIdentity(cfg.role.value, cfg.name)
        if cfg.role is Role.P:
            handler = self._start_producer(region, identity)
        else:
            index = self.bridge.prefix_index
            assert index is not None  # a consumer's bridge keeps vLLM's prefix cache
            handler = await self._start_consumer(region, index, identity)
        await self.bridge.serve(handler, self.engine_lost)
        return self

    def _start_producer(self, region: ShmRegion, identity: PeerIdentity) -> Any:
        """P: the KV peers it ships to (MD across the WAN, RLD on the fast path; with pools, each
        instance of the topology by its name) and the bridge."""
        cfg = self.cfg
        if cfg.md_addr:
            self._md = self._wan_peer(cfg.md_addr, identity)
        if cfg.rld_addr:
            self._rld = self._fast_peer(cfg.rld_addr, identity)
        if cfg.md_peers:
            self._named["md"] = {name: self._wan_peer(addr, identity) for name, addr in cfg.md_peers}
        if cfg.rld_peers:
            self._named["rld"] = {name: self._fast_peer(addr, identity) for name, addr in cfg.rld_peers}
        self.producer = ProducerBridge(
            region,
            self._md,
            rld=self._rld,
            named=self._named,
            model_id=cfg.model_id,
            block_size=cfg.block_size,
            chunk_bytes=cfg.options.chunk_bytes,
            wan_codec=WanCodec(cfg.wan_codec, line_mbit=cfg.wan_line_mbit),
        )
        return self.producer.handle

    def _wan_peer(self, addr: str, identity: PeerIdentity) -> KVPeer:
        cfg = self.cfg
        tls = self._tls(identity)
        return KVPeer(addr, identity=identity, tls=tls, transport=cfg.transport, options=cfg.options)

    def _fast_peer(self, addr: str, identity: PeerIdentity) -> KVPeer:
        """A peer on the fast path ("auto": RDMA where a device is, else TCP)."""
        cfg = self.cfg
        transport = cfg.rld_transport
        if transport == "auto":
            self.fast_path = self.fast_path or choose_fast_path()
            transport = self.fast_path.name
        return KVPeer(
            addr,
            identity=identity,
            tls=self._tls(identity),
            transport=transport,
            options=LinkOptions(streams=1, chunk_bytes=cfg.options.chunk_bytes),
        )

    async def _start_consumer(self, region: ShmRegion, index: PrefixIndex, identity: PeerIdentity) -> Any:
        """MD and RLD: the KV server and the bridge that lands transfers, answering P's
        reservations from ``index`` (vLLM's prefix cache, as the engine bridge's feed keeps it)."""
        cfg = self.cfg
        self.consumer = ConsumerBridge(region, index, block_size=cfg.block_size, orphan_s=cfg.orphan_s)
        self._kv = await KVServer.start(
            cfg.kv_host,
            cfg.kv_port,
            identity=identity,
            tls=self._tls(identity),
            on_transfer=self.consumer.on_transfer,
            on_message=self.consumer.on_message,
            on_transfer_failed=self.consumer.on_transfer_failed,
            transport=cfg.transport,
            options=cfg.options,
        )
        self._sweeper = asyncio.ensure_future(self._sweep_forever(self.consumer))
        return self.consumer.handle

    def engine_lost(self, reason: str) -> None:
        """The vLLM beside this sidecar died: nothing held for it stays (see ``engine_watch``)."""
        if self.producer is not None:
            self.producer.engine_lost(reason)
        if self.consumer is not None:
            self.consumer.engine_lost(reason)

    @staticmethod
    async def _sweep_forever(consumer: ConsumerBridge) -> None:
        """Frees what a consumer that went away (vLLM killed) left landed, without any call."""
        while True:
            await asyncio.sleep(min(1.0, consumer.orphan_s / 4))
            consumer.sweep()

    def status(self) -> dict[str, Any]:
        bridge = self.producer or self.consumer
        if self.consumer is not None:
            self.consumer.sweep()  # as its STATUS over the control channel does
        out = bridge.status() if bridge is not None else {}
        out.update(self.bridge.status())
        rld = self._rld or next(iter(self._named.get("rld", {}).values()), None)
        if rld is not None:
            out["fast_path"] = rld.transport_name
        return out

    async def close(self) -> None:
        await self.bridge.stop_serving()  # vLLM's connector calls no more
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(BaseException):
                await self._sweeper
        if self.producer is not None:
            await self.producer.close()
        named = [peer for peers in self._named.values() for peer in peers.values()]
        for peer in (self._md, self._rld, *named):
            if peer is not None:
                await peer.drop()
        if self._kv is not None:
            await self._kv.close()
        await self.bridge.close()
