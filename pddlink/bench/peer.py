"""The receiver and sender processes of ``pddlink bench link``.

Each prints JSON lines on stdout for the coordinator: the receiver ``{"event": "listening",
"port": N}`` once it accepts connections, then ``{"event": "done", ...}``; the sender only
``{"event": "done", ...}`` with its timing and counters. CPU time is this process's user+system
time over the transfers (set-up excluded), from ``resource.getrusage``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pddlink import eventloop
from pddlink.errors import ErrorCode, PddlinkError
from pddlink.kv.codec import CodecId
from pddlink.transport.api import KVClient, KVServer
from pddlink.transport.base import LinkOptions, ReceivedTransfer, TransferResult
from pddlink.transport.pki import load_or_create_peer
from pddlink.transport.tls import PeerIdentity, TlsConfig
from pddlink.wire.transfer_messages import KVLayoutSpec, TransferBegin

log = logging.getLogger("pddlink.bench.link")
RECEIVER = PeerIdentity("bench", "receiver")
SENDER = PeerIdentity("bench", "sender")
IN_FLIGHT_TRANSFERS = 2  # the next transfer starts while the last one's tail drains, as in a sidecar
SOURCE_BYTES = 512 << 20
_LAYOUT = KVLayoutSpec("bench/random", 1, 1, 128, "bfloat16", 16)


@dataclass(frozen=True, slots=True)
class BenchSpec:
    transport: str
    streams: int
    total_bytes: int
    chunk_bytes: int
    transfer_bytes: int
    codec: str
    congestion_control: str
    tls: bool
    quic_impl: str
    deadline_s: float
    certs: Path | None
    max_datagram_bytes: int = 8952  # QUIC: loopback's MTU allows jumbo datagrams; WAN paths 1452
    # auto: uvloop for TCP (fewer wakeup costs on large writes); asyncio's loop for QUIC, which was
    # 5-15% faster with qh3 in paired runs here (its timer-driven pacing)
    event_loop: str = "auto"
    line_rate_bps: float = 0.0  # pace the stripes to this line rate (0: unpaced), LinkOptions.line_rate_bps

    def options(self) -> LinkOptions:
        return LinkOptions(
            streams=self.streams,
            congestion_control=self.congestion_control,
            chunk_bytes=self.chunk_bytes,
            window_bytes=max(32 << 20, 2 * self.chunk_bytes),
            max_datagram_bytes=self.max_datagram_bytes,
            line_rate_bps=self.line_rate_bps,
        )

    def tls_for(self, identity: PeerIdentity) -> TlsConfig | None:
        if not self.tls:
            return None
        if self.certs is None:
            raise PddlinkError("--tls needs --certs DIR (the coordinator passes one)")
        return load_or_create_peer(self.certs, identity)

    def transfer_sizes(self) -> list[int]:
        full, rest = divmod(self.total_bytes, self.transfer_bytes)
        return [self.transfer_bytes] * full + ([rest] if rest else [])


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_role(role: Callable[[BenchSpec, str], Coroutine[Any, Any, None]], spec: BenchSpec, addr: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("quic").setLevel(logging.ERROR)  # qh3 warns on every orderly peer close
    if spec.transport == "quic":
        from pddlink.transport.quic import QuicTransport

        QuicTransport.impl = spec.quic_impl
    uv = spec.event_loop == "uvloop" or (spec.event_loop == "auto" and spec.transport == "tcp")
    eventloop.run(role(spec, addr), prefer_uvloop=uv, warn_without=True)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


async def receive(spec: BenchSpec, addr: str) -> None:
    sizes = spec.transfer_sizes()
    done = asyncio.Event()
    received_bytes: list[int] = []

    failures: list[dict[str, str]] = []

    def on_failed(peer: PeerIdentity, begin: object, error: PddlinkError) -> None:
        log.error("transfer failed: %s (%s)", error.message, error.code.name)
        failures.append({"code": ErrorCode(error.code).name, "reason": error.message})
        done.set()

    def on_transfer(received: ReceivedTransfer) -> None:  # KVServer decoded a kv-codec payload
        received_bytes.append(received.bytes)
        received.release()
        if len(received_bytes) == len(sizes):
            done.set()

    host, port = _split(addr)
    server = await KVServer.start(
        host,
        port,
        identity=RECEIVER,
        tls=spec.tls_for(RECEIVER),
        on_transfer=on_transfer,
        on_transfer_failed=on_failed,
        transport=spec.transport,
        options=spec.options(),
    )
    cpu_start = cpu_seconds()
    emit({"event": "listening", "port": server.port})
    try:
        await asyncio.wait_for(done.wait(), spec.deadline_s + 30)
        for _ in range(500):  # let the sender read its figures and close first (quiet shutdown)
            if not server.links():
                break
            await asyncio.sleep(0.01)
    finally:
        await server.close()
    emit(
        {
            "event": "done",
            "bytes": sum(received_bytes),
            "cpu_s": cpu_seconds() - cpu_start,
            "failures": failures,
        }
    )


def make_payload(nbytes: int, codec: str) -> np.ndarray:
    rng = np.random.default_rng(1)
    if codec == "none":
        words = rng.integers(0, 2**63, size=-(-nbytes // 8), dtype=np.uint64)  # fast incompressible bytes
        return words.view(np.uint8)[:nbytes]
    # bf16 with Gaussian-like values: the top half of float32 normals
    values = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def begin_for(index: int, nbytes: int, spec: BenchSpec, deadline_s: float) -> TransferBegin:
    return TransferBegin(
        transfer_id=index + 1,
        generation=0,
        request_id=f"bench-{index}",
        layout=_LAYOUT,
        first_block=0,
        num_tokens=1,
        block_hashes=(),
        codec=CodecId.PLANES_ZSTD if spec.codec == "kv" else CodecId.RAW,
        total_bytes=nbytes,
        chunk_bytes=spec.chunk_bytes,
        deadline_ms=int(deadline_s * 1000),
    )


async def send(spec: BenchSpec, addr: str) -> None:
    sizes = spec.transfer_sizes()
    # Every transfer sends its own region of a source larger than the CPU caches, as KV of different
    # requests would be: re-sending one cache-resident buffer would flatter the figure.
    source_bytes = min(spec.total_bytes, max(max(sizes), SOURCE_BYTES))
    payload = memoryview(make_payload(source_bytes, spec.codec).data).cast("B")
    host, port = _split(addr)
    t_connect = time.perf_counter()
    client = await KVClient.connect(
        host,
        port,
        identity=SENDER,
        tls=spec.tls_for(SENDER),
        expected_peer=RECEIVER if spec.tls else None,
        transport=spec.transport,
        options=spec.options(),
    )
    connect_s = time.perf_counter() - t_connect
    progress = _progress(spec.total_bytes)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    results: list[TransferResult] = []
    error: PddlinkError | None = None
    slots = asyncio.Semaphore(IN_FLIGHT_TRANSFERS)

    wire_bytes: list[int] = []

    async def one(i: int, size: int) -> None:
        async with slots:
            left = spec.deadline_s - (time.perf_counter() - t0)
            start = (i * spec.transfer_bytes) % (len(payload) - size + 1) // 4096 * 4096  # keep bf16 aligned
            data = payload[start : start + size]
            begin = begin_for(i, len(data), spec, left)
            result = await client.send_transfer(begin, data, deadline_s=left)  # KVClient encodes
            wire_bytes.append(result.bytes)
            results.append(result)
            progress.update(size)

    try:
        await asyncio.gather(*(one(i, size) for i, size in enumerate(sizes)))
    except PddlinkError as exc:
        error = exc
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    stats = client.stats()
    await client.close()
    progress.close()
    out: dict[str, Any] = {
        "event": "done",
        "seconds": seconds,
        "connect_s": connect_s,
        "cpu_s": cpu,
        "retransmits": stats.retransmits,
        "rtt_ms": None if stats.rtt_s is None else stats.rtt_s * 1e3,
        "wire_bytes": sum(wire_bytes),
        "resent_chunks": sum(r.resent_chunks for r in results),
        "reconnects": sum(r.reconnects for r in results),
        "congestion_control": stats.congestion_control,
    }
    if error is not None:
        out["error"] = {"code": ErrorCode(error.code).name, "reason": error.message}
    emit(out)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, disable=not sys.stderr.isatty())
