"""When compressing KV pays: a measured sample in, a codec verdict (with its reason) out.

Compression is worth it only when it makes the transfer finish sooner. With frames pipelined
(compress frame i+1 while frame i is on the wire) the raw-KV rate a transfer reaches is
``min(link * ratio, compress_speed * threads, decompress_speed * threads)`` against ``link``
without it. The policy therefore skips compression for dtypes the codec cannot shrink (fp8, int8,
fp32, fp64), for data whose measured ratio is below ``min_ratio`` (about 1.1: the gain would not
repay the CPU), and for links faster than the compressor.

Lifecycle: a sender measures one ``CodecSample`` per transfer (or per layout, cached) with
``measure_sample`` on a slice of the KV it is about to send, then asks ``CodecPolicy.choose`` with
the link estimate. ``choose`` is pure; ``measure_sample`` takes its clock as an argument.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pddlink.errors import ConfigError, InvalidInput
from pddlink.kv.codec import CodecId, encode_chunk, iter_chunks
from pddlink.kv.dtypes import KVDtype

GB = 1e9


@dataclass(frozen=True, slots=True)
class CodecSample:
    """Codec figures measured on a slice of real KV: ratio and single-thread speeds (GB/s of raw KV)."""

    dtype: KVDtype
    sample_bytes: int
    ratio: float
    compress_gb_per_s: float

    def __post_init__(self) -> None:
        if self.sample_bytes < 0 or self.ratio <= 0 or self.compress_gb_per_s <= 0:
            raise InvalidInput(f"codec sample figures must be positive: {self}")


@dataclass(frozen=True, slots=True)
class CodecDecision:
    codec: CodecId
    reason: str  # for logs and metrics: why this codec


@dataclass(frozen=True, slots=True)
class CodecPolicy:
    """Thresholds for ``choose``. ``threads``: encoder threads the sender will run."""

    min_ratio: float = 1.1
    threads: int = 1
    min_speedup: float = 1.05  # compression must make the transfer at least this much faster

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
        coded = min(link_gb_per_s * sample.ratio, sample.compress_gb_per_s * self.threads)
        if coded < link_gb_per_s * self.min_speedup:
            speed = f"{self.threads} x {sample.compress_gb_per_s:.2f} GB/s"
            return CodecDecision(CodecId.RAW, f"link {link_gbps:.1f} Gbit/s outpaces {speed} compression")
        return CodecDecision(
            CodecId.PLANES_ZSTD, f"ratio {sample.ratio:.2f}, {coded / link_gb_per_s:.2f}x faster"
        )


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
    encoded = sum(len(encode_chunk(c, kind)) for c in picked)
    elapsed = max(clock() - start, 1e-9)
    raw = sum(len(c) for c in picked)
    return CodecSample(kind, raw, raw / encoded, raw / elapsed / GB)
