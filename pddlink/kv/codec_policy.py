"""When compressing KV pays: a measured sample in, a codec verdict (with its reason) out.

Compression is worth it only when it makes the transfer finish sooner. With frames pipelined
(compress frame i+1 while frame i is on the wire) the raw-KV rate a transfer reaches is
``min(link * ratio, compress_speed * threads, decompress_speed * threads)`` against ``link``
without it. A transfer that compresses its whole payload before sending and decodes it after the
last byte arrived (``pipelined=False``, what ``pddlink.transport.KVClient`` does) pays the three in
series: ``1/(compress * threads) + 1/(link * ratio) + 1/(decompress * threads)`` seconds per raw byte
against ``1/link``. The policy therefore skips compression for dtypes the codec cannot shrink (fp8,
int8, fp64), for data whose measured ratio is below ``min_ratio`` (about 1.1: the gain would
not repay the CPU), and for links faster than the compressor.

Lifecycle: a sender measures one ``CodecSample`` per transfer (or per layout, cached) with
``measure_sample`` on a slice of the KV it is about to send, then asks ``CodecPolicy.choose`` with
the link estimate. ``LinkCodecChooser`` is that loop for one link: a sample per dtype (measured at
start on synthetic KV-like values of a dtype, or on the first real KV of a dtype), the ratio then
followed from what each compressed transfer achieved. fp32 KV goes through the same loop: its
ratio is lower (about 1.2x: three of its four bytes are mantissa, sent raw), so it pays only on a
line well below the compressor's rate. ``choose`` is pure; the measuring functions take their clock
as an argument.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from pddlink.errors import ConfigError, InvalidInput
from pddlink.kv.codec import CodecId, decode_chunk, encode_chunk, iter_chunks
from pddlink.kv.dtypes import KVDtype

GB = 1e9


@dataclass(frozen=True, slots=True)
class CodecSample:
    """Codec figures measured on a slice of KV: ratio and single-thread speeds (GB/s of raw KV).
    ``decompress_gb_per_s`` is infinite when it was not measured."""

    dtype: KVDtype
    sample_bytes: int
    ratio: float
    compress_gb_per_s: float
    decompress_gb_per_s: float = math.inf

    def __post_init__(self) -> None:
        if (
            self.sample_bytes < 0
            or self.ratio <= 0
            or self.compress_gb_per_s <= 0
            or self.decompress_gb_per_s <= 0
        ):
            raise InvalidInput(f"codec sample figures must be positive: {self}")


@dataclass(frozen=True, slots=True)
class CodecDecision:
    codec: CodecId
    reason: str  # for logs and metrics: why this codec


@dataclass(frozen=True, slots=True)
class CodecPolicy:
    """Thresholds for ``choose``. ``threads``: encoder (and decoder) threads each side runs;
    ``pipelined``: whether frames go on the wire while later ones are still being compressed."""

    min_ratio: float = 1.1
    threads: int = 1
    min_speedup: float = 1.05  # compression must make the transfer at least this much faster
    pipelined: bool = True

    def __post_init__(self) -> None:
        if self.min_ratio < 1.0:
            raise ConfigError(f"codec.min_ratio must be >= 1.0, got {self.min_ratio}")
        if self.threads < 1:
            raise ConfigError(f"codec.threads must be >= 1, got {self.threads}")
        if self.min_speedup < 1.0:
            raise ConfigError(f"codec.min_speedup must be >= 1.0, got {self.min_speedup}")

    def choose(self, dtype: KVDtype | str, link_gbps: float, sample: CodecSample | None) -> CodecDecision:
        """The codec for a transfer of ``dtype`` KV over a link of ``link_gbps`` Gbit/s."""
        kind = KVDtype.parse(dtype)
        if link_gbps <= 0:
            raise InvalidInput(f"link_gbps must be positive, got {link_gbps}")
        if not kind.plane_codable:
            return CodecDecision(CodecId.RAW, f"{kind.name} does not compress losslessly")
        if sample is None:
            return CodecDecision(CodecId.RAW, "no codec sample measured yet")
        if sample.ratio < self.min_ratio:
            return CodecDecision(CodecId.RAW, f"sample ratio {sample.ratio:.2f} < {self.min_ratio:.2f}")
        link_gb_per_s = link_gbps / 8
        coded = self.coded_gb_per_s(link_gb_per_s, sample)
        if coded < link_gb_per_s * self.min_speedup:
            speed = f"{self.threads} x {sample.compress_gb_per_s:.2f} GB/s"
            return CodecDecision(CodecId.RAW, f"link {link_gbps:.3g} Gbit/s outpaces {speed} compression")
        return CodecDecision(
            CodecId.PLANES_ZSTD, f"ratio {sample.ratio:.2f}, {coded / link_gb_per_s:.2f}x faster"
        )

    def coded_gb_per_s(self, link_gb_per_s: float, sample: CodecSample) -> float:
        """The raw-KV rate a compressed transfer reaches over a link of ``link_gb_per_s`` GB/s."""
        compress = sample.compress_gb_per_s * self.threads
        decompress = sample.decompress_gb_per_s * self.threads
        if self.pipelined:
            return min(link_gb_per_s * sample.ratio, compress, decompress)
        return 1.0 / (1.0 / compress + 1.0 / (link_gb_per_s * sample.ratio) + 1.0 / decompress)


def measure_sample(
    data: memoryview | bytes | bytearray,
    dtype: KVDtype | str,
    *,
    sample_bytes: int = 1 << 20,
    clock: Callable[[], float] = time.perf_counter,
) -> CodecSample:
    """Encode up to ``sample_bytes`` of ``data`` (chunks spread over it) and time it with ``clock``."""
    kind = KVDtype.parse(dtype)
    view = memoryview(data).cast("B")
    if not view:
        raise InvalidInput("cannot sample an empty buffer")
    chunk = max(kind.itemsize, min(256 << 10, sample_bytes) // kind.itemsize * kind.itemsize)
    chunks = list(iter_chunks(view, chunk, kind.itemsize))
    stride = max(1, len(chunks) * chunk // max(sample_bytes, 1))
    picked = chunks[::stride][: max(1, sample_bytes // chunk)]
    start = clock()
    frames = [encode_chunk(c, kind) for c in picked]
    middle = clock()
    for frame in frames:
        decode_chunk(frame)
    end = clock()
    raw = sum(len(c) for c in picked)
    encoded = sum(len(f) for f in frames)
    compress_s, decompress_s = max(middle - start, 1e-9), max(end - middle, 1e-9)
    return CodecSample(kind, raw, raw / encoded, raw / compress_s / GB, raw / decompress_s / GB)


def synthetic_kv(dtype: KVDtype | str, nbytes: int, *, seed: int = 0) -> bytes:
    """KV-like bytes of a float dtype the codec compresses: Gaussian values (scale 1), for
    measuring the compressor's speed before any real KV exists. Its ratio is only a first guess."""
    kind = KVDtype.parse(dtype)
    if not kind.plane_codable:
        raise InvalidInput(f"no synthetic KV for {kind.name}: the codec does not compress it")
    values = np.random.default_rng(seed).standard_normal(nbytes // kind.itemsize, dtype=np.float32)
    if kind is KVDtype.float32:
        return values.astype("<f4").tobytes()
    if kind is KVDtype.float16:
        return values.astype("<f2").tobytes()
    return (values.view("<u4") >> np.uint32(16)).astype("<u2").tobytes()  # bf16: the top 16 bits


class LinkCodecChooser:
    """The codec decision for one link, from measurements: per-dtype samples and achieved ratios.

    ``measure_at_start`` times the compressor on synthetic KV of a dtype (speed is what the
    decision needs first); ``choose(dtype, link_bytes_per_s, data)`` measures a sample on ``data`` for a
    dtype it has none for; ``observe(dtype, raw, wire)`` after each compressed transfer moves the
    ratio towards what real KV gives (exponentially weighted). Not thread-safe; one per link."""

    def __init__(self, policy: CodecPolicy, *, ratio_weight: float = 0.3) -> None:
        if not 0 < ratio_weight <= 1:
            raise ConfigError(f"ratio_weight must be in (0, 1], got {ratio_weight}")
        self.policy = policy
        self.ratio_weight = ratio_weight
        self.samples: dict[KVDtype, CodecSample] = {}

    def measure_at_start(
        self, dtype: KVDtype | str = KVDtype.bfloat16, *, sample_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.perf_counter,
    ) -> CodecSample:  # fmt: skip
        kind = KVDtype.parse(dtype)
        data = synthetic_kv(kind, sample_bytes)
        decode_chunk(encode_chunk(data[: 64 << 10], kind))  # this thread's zstd contexts, made untimed
        sample = measure_sample(data, kind, sample_bytes=sample_bytes, clock=clock)
        self.samples[kind] = sample
        return sample

    def choose(
        self,
        dtype: KVDtype | str,
        link_bytes_per_s: float | None,
        data: memoryview | bytes | bytearray | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> CodecDecision:
        """The codec for the next transfer; ``link_bytes_per_s`` None: the link is not measured yet."""
        kind = KVDtype.parse(dtype)
        if not kind.plane_codable:
            return CodecDecision(CodecId.RAW, f"{kind.name} does not compress losslessly")
        if link_bytes_per_s is None:
            return CodecDecision(CodecId.RAW, "link rate not measured yet")
        sample = self.samples.get(kind)
        if sample is None and data is not None and len(memoryview(data).cast("B")) >= kind.itemsize:
            sample = self.samples[kind] = measure_sample(data, kind, clock=clock)
        return self.policy.choose(kind, link_bytes_per_s * 8 / GB, sample)

    def observe(
        self, dtype: KVDtype | str, raw_bytes: int, wire_bytes: int, compress_s: float | None = None
    ) -> None:
        """A compressed transfer's result: ``raw_bytes`` of KV travelled as ``wire_bytes``, encoded in
        ``compress_s`` seconds on ``policy.threads`` threads (when known: the speed follows too)."""
        kind = KVDtype.parse(dtype)
        sample = self.samples.get(kind)
        if sample is None or raw_bytes <= 0 or wire_bytes <= 0:
            return
        w = self.ratio_weight
        ratio = (1 - w) * sample.ratio + w * (raw_bytes / wire_bytes)
        speed = sample.compress_gb_per_s
        if compress_s is not None and compress_s > 0:
            measured = raw_bytes / compress_s / GB / self.policy.threads
            speed = (1 - w) * speed + w * measured
        self.samples[kind] = replace(sample, ratio=ratio, compress_gb_per_s=speed)
