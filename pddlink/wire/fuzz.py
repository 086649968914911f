"""A deterministic frame fuzzer for the decoder, shared by the CI test and ``pddlink bench wire``.

Frames come from a corpus of valid messages of every type, mutated in ways that reach every layer
of the decoder: raw bit flips and truncations (mostly stopped by the CRCs), the same mutations with
the CRCs fixed afterwards (so the body decoder and message validation see them), random headers
with valid CRCs, random bodies under a valid header, and plain random bytes. Each frame goes to a
fresh decoder, whole or split at random points. The contract checked: only ``WireError`` is raised,
feeding always returns, and the decoder never buffers more than one frame's limits.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pddlink.errors import ErrorCode
from pddlink.handoff.plan import HandoffMode
from pddlink.kv.codec import CodecId
from pddlink.wire.codec import Decoder, encode
from pddlink.wire.errors import WireError
from pddlink.wire.frame import HEADER_BYTES, MESSAGE_TYPES, WIRE_VERSION, WireMessage
from pddlink.wire.messages import (
    Error,
    Handoff,
    Hello,
    HelloAccept,
    HelloRefuse,
    IndexEvent,
    IndexEventKind,
    IndexEvents,
    IndexSnapshot,
    IndexSnapshotRequest,
    Ping,
    Pong,
    Release,
    Reserve,
    ReserveAnswer,
)
from pddlink.wire.rdma_messages import (
    ChannelRole,
    PathMtu,
    RdmaCredit,
    RdmaDecline,
    RdmaEndpoint,
    RdmaReady,
    RdmaSetup,
)
from pddlink.wire.transfer_messages import (
    Abort,
    Ack,
    Chunk,
    KVLayoutSpec,
    Resume,
    TransferBegin,
    TransferEnd,
)

_LAYOUT = KVLayoutSpec("model", 4, 8, 128, "bfloat16", 16)
_RDMA_RECEIVER = RdmaEndpoint(
    ChannelRole.RECEIVER, 0x1234, 77, 0, 1, PathMtu.MTU_1024, bytes(range(16)), 0xABCD, 1 << 40, 16, 4 << 20
)


def corpus() -> list[WireMessage]:
    """One or more valid messages of every registered type."""
    hashes = tuple(range(1, 9))
    return [
        Hello("p-dc-a", "p", 1, 1, ("zstd", "striping")),
        HelloAccept("md-dc-b", "md", 1, 1, ("zstd",)),
        HelloRefuse(ErrorCode.HASH_SCHEME_MISMATCH, "unknown hash scheme 9", 1),
        Ping(1, 123_456_789),
        Pong(1, 123_456_789, 987_654_321),
        Error(ErrorCode.BAD_REQUEST, "no such request", "req-1"),
        TransferBegin(9, 0, "req-1", _LAYOUT, 0, 128, hashes, CodecId.PLANES_ZSTD, 1 << 20, 1 << 16, 30_000),
        Chunk(9, 0, 3, 3 << 16, 0x1234_5678_9ABC, bytes(range(256)) * 2),
        Ack(9, 1, 4, (6, 7), (5,)),
        Resume(9, 2, 4, (6,)),
        TransferEnd(9, 2, 16, 2**100 + 7),
        Abort(9, 2, ErrorCode.DEADLINE_EXCEEDED, "deadline"),
        Handoff("req-1", 4096, tuple(range(1000, 1100)), 7, 0.8, 20, 0.9, 512, (2,), HandoffMode.CATCH_UP, 2),
        IndexEvents(
            4, (IndexEvent(1, IndexEventKind.STORED, 5, hashes), IndexEvent(2, IndexEventKind.REMOVED))
        ),
        IndexSnapshotRequest(4, 2),
        IndexSnapshot(4, 2, b"\x00snapshot" * 8),
        Reserve("req-1", hashes, 2000),
        ReserveAnswer("req-1", 11, 8, 2000),
        Release(11),
        RdmaSetup(_RDMA_RECEIVER),
        RdmaReady(),
        RdmaDecline(ErrorCode.UNAVAILABLE, "no RDMA device"),
        RdmaCredit((0, 1, 15)),
    ]


def fix_crcs(frame: bytearray) -> bytearray:
    """Recompute body and header CRCs of a (possibly mutated) frame in place."""
    if len(frame) < HEADER_BYTES:
        return frame
    body_len = int.from_bytes(frame[16:20], "little")
    body = frame[HEADER_BYTES : HEADER_BYTES + body_len]
    frame[24:28] = zlib.crc32(body).to_bytes(4, "little")
    frame[28:32] = zlib.crc32(frame[:28]).to_bytes(4, "little")
    return frame


@dataclass
class FuzzReport:
    frames: int = 0
    messages: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    max_buffered_bytes: int = 0


class FrameFuzzer:
    """Generates mutated frames from a seed; ``run(n)`` feeds them and reports what came out."""

    def __init__(self, seed: int, *, max_body_bytes: int = 1 << 20, max_payload_bytes: int = 1 << 20) -> None:
        self.rng = random.Random(seed)
        self.frames = [encode(m) for m in corpus()]
        self.max_body_bytes = max_body_bytes
        self.max_payload_bytes = max_payload_bytes
        self._mutators: list[Callable[[], bytes]] = [
            self._flip,
            self._flip_fixed,
            self._truncate,
            self._splice,
            self._random_header,
            self._random_body,
            self._random_bytes,
            self._valid,
        ]

    def frame(self) -> bytes:
        return self.rng.choice(self._mutators)()

    def run(self, n: int, progress: Callable[[int], None] | None = None) -> FuzzReport:
        report = FuzzReport()
        for i in range(n):
            self.feed_one(self.frame(), report)
            if progress is not None and i % 10_000 == 9_999:
                progress(10_000)
        return report

    def feed_one(self, frame: bytes, report: FuzzReport) -> None:
        """Feed one frame (whole or in pieces) to a fresh decoder; non-wire errors propagate."""
        dec = Decoder(max_body_bytes=self.max_body_bytes, max_payload_bytes=self.max_payload_bytes)
        report.frames += 1
        try:
            for piece in self._pieces(frame):
                report.messages += len(dec.feed(piece))
                report.max_buffered_bytes = max(report.max_buffered_bytes, dec.buffered_bytes)
        except WireError as exc:
            report.errors[type(exc).__name__] += 1

    def _pieces(self, frame: bytes) -> list[bytes]:
        if len(frame) < 2 or self.rng.random() < 0.7:
            return [frame]
        cuts = sorted(self.rng.sample(range(1, len(frame)), min(3, len(frame) - 1)))
        return [frame[a:b] for a, b in zip([0, *cuts], [*cuts, len(frame)], strict=True)]

    # --- mutators -----------------------------------------------------------------------------

    def _base(self) -> bytearray:
        return bytearray(self.rng.choice(self.frames))

    def _mutate(self, frame: bytearray) -> bytearray:
        for _ in range(self.rng.randint(1, 4)):
            pos = self.rng.randrange(len(frame))
            if self.rng.random() < 0.5:
                frame[pos] ^= 1 << self.rng.randrange(8)
            else:
                frame[pos] = self.rng.randrange(256)
        return frame

    def _flip(self) -> bytes:
        return bytes(self._mutate(self._base()))

    def _flip_fixed(self) -> bytes:
        frame = self._base()
        body_pos = self.rng.randrange(HEADER_BYTES, len(frame)) if len(frame) > HEADER_BYTES else 0
        frame[body_pos] = self.rng.randrange(256)
        if self.rng.random() < 0.3:
            frame = self._mutate(frame)
        return bytes(fix_crcs(frame))

    def _truncate(self) -> bytes:
        frame = self._base()
        return bytes(fix_crcs(frame[: self.rng.randrange(len(frame))]))

    def _splice(self) -> bytes:
        a, b = self._base(), self._base()
        return bytes(a[: self.rng.randrange(len(a))] + b[self.rng.randrange(len(b)) :])

    def _random_header(self) -> bytes:
        head = bytearray(b"PDLK" + self.rng.randbytes(HEADER_BYTES - 4))
        head[4] = WIRE_VERSION if self.rng.random() < 0.8 else head[4]
        head[5] = self.rng.choice(list(MESSAGE_TYPES)) if self.rng.random() < 0.8 else head[5]
        if self.rng.random() < 0.8:
            head[6:8] = b"\0\0"
        body_len = self.rng.choice([0, 1, 7, 64, self.rng.randrange(1 << 32)])
        head[16:20] = body_len.to_bytes(4, "little")
        payload_len = self.rng.choice([0, 0, 3, self.rng.randrange(1 << 32)])
        head[20:24] = payload_len.to_bytes(4, "little")
        body = self.rng.randbytes(min(body_len, 256))
        return bytes(fix_crcs(head + body) + self.rng.randbytes(min(payload_len, 64)))

    def _random_body(self) -> bytes:
        frame = self._base()
        body = self.rng.randbytes(self.rng.randrange(64))
        frame[16:20] = len(body).to_bytes(4, "little")
        frame[20:24] = b"\0\0\0\0"
        return bytes(fix_crcs(frame[:HEADER_BYTES] + body))

    def _random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.randrange(1, 96))

    def _valid(self) -> bytes:
        return bytes(self._base())
