"""P's codec choice for the WAN leg: compress KV (bf16, fp16, fp32) when the line is slower than the
compressor.

One ``WanCodec`` per WAN line (P's pool of links to one MD). At start it times the codec on
synthetic bf16 and fp32 KV (``LinkCodecChooser.measure_at_start``; fp16 is sampled on its first
real KV); for every transfer it takes the rate a
new flow gets on the line now -- from a ``pddlink.routing.LinkModel`` seeded with the configured
line rate (``data_plane.wan_line_mbit``) and fed by the transfers it sees, or, with no line rate
configured, the goodput measured on earlier transfers (the first one then goes RAW) -- and asks
the chooser, which prices compress + wire + decompress in series (``KVClient`` encodes the whole
payload before sending). Compressed transfers feed their achieved ratio back. ``mode`` "raw" or
"planes_zstd" forces a codec (for operators and tests); the decision's reason says which applied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pddlink.errors import ConfigError, InvalidInput
from pddlink.kv.codec import CodecId, KVDtype
from pddlink.kv.codec_policy import CodecDecision, CodecPolicy, CodecSample, LinkCodecChooser
from pddlink.routing import LinkModel
from pddlink.transport import TransferResult
from pddlink.transport.api import CODEC_THREADS

MODES = ("auto", "raw", "planes_zstd")
START_DTYPES = (KVDtype.bfloat16, KVDtype.float32)  # sampled at start: the dtypes vLLM and the engine run
_GOODPUT_WEIGHT = 0.3


@dataclass(frozen=True, slots=True)
class WanCodecStatus:
    mode: str
    line_bytes_per_s: float | None
    rate_bytes_per_s: float | None  # what the next transfer's decision uses
    sample: CodecSample | None  # bf16's
    samples: dict[str, CodecSample]  # every dtype measured so far, by name


class WanCodec:
    def __init__(
        self, mode: str = "auto", *, line_mbit: float = 0.0, rtt_s: float = 0.0, pool_size: int = 8
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"data_plane.wan_codec must be one of {', '.join(MODES)}, got {mode!r}")
        if line_mbit < 0:
            raise ConfigError(f"data_plane.wan_line_mbit must be >= 0, got {line_mbit}")
        self.mode = mode
        self.chooser = LinkCodecChooser(CodecPolicy(threads=CODEC_THREADS, pipelined=False))
        if mode == "auto":
            for kind in START_DTYPES:
                self.chooser.measure_at_start(kind)
        self.model = LinkModel(line_mbit * 1e6 / 8, rtt_s, pool_size=pool_size) if line_mbit else None
        self._goodput: float | None = None

    def rate_bytes_per_s(self, now: float) -> float | None:
        """The rate a transfer started now would get: the model's fair share, or measured goodput."""
        if self.model is not None:
            return self.model.estimate(now).share_bytes_per_s
        return self._goodput

    def decide(self, dtype: str, payload: memoryview, now: float | None = None) -> CodecDecision:
        if self.mode == "raw":
            return CodecDecision(CodecId.RAW, "data_plane.wan_codec = raw")
        try:
            kind = KVDtype.parse(dtype)
        except InvalidInput:
            return CodecDecision(CodecId.RAW, f"KV dtype {dtype!r} is not one the codec knows")
        if self.mode == "planes_zstd":
            if kind.plane_codable:
                return CodecDecision(CodecId.PLANES_ZSTD, "data_plane.wan_codec = planes_zstd")
            return CodecDecision(CodecId.RAW, f"{kind.name} does not compress losslessly")
        rate = self.rate_bytes_per_s(time.monotonic() if now is None else now)
        return self.chooser.choose(kind, rate, payload)

    def started(self, flow_id: str, wire_bytes_estimate: int, now: float) -> None:
        if self.model is not None:
            self.model.start_flow(flow_id, wire_bytes_estimate, now)

    def finished(
        self, flow_id: str, dtype: str, result: TransferResult | None, now: float, rtt_s: float | None = None
    ) -> None:
        """After a transfer: ``result`` None when it failed."""
        if self.model is not None:
            sent = (result.bytes, result.seconds) if result is not None else None
            self.model.finish_flow(flow_id, now, completed=result is not None, sent=sent)
            if rtt_s:
                self.model.observe_rtt(rtt_s, now)
        if result is None:
            return
        if result.codec is not CodecId.RAW:
            self.chooser.observe(dtype, result.kv_bytes, result.bytes, result.codec_seconds or None)
        wire_s = result.seconds
        if result.bytes > 0 and wire_s > 0:
            sample = result.bytes / wire_s
            g = self._goodput
            self._goodput = sample if g is None else (1 - _GOODPUT_WEIGHT) * g + _GOODPUT_WEIGHT * sample

    def status(self, now: float) -> WanCodecStatus:
        line = self.model.line_bytes_per_s if self.model is not None else None
        samples = self.chooser.samples
        return WanCodecStatus(
            self.mode,
            line,
            self.rate_bytes_per_s(now),
            samples.get(KVDtype.bfloat16),
            {kind.name: sample for kind, sample in samples.items()},
        )

    def status_json(self, now: float) -> dict[str, Any]:
        st = self.status(now)
        return {
            "mode": st.mode,
            "line_bytes_per_s": st.line_bytes_per_s,
            "rate_bytes_per_s": st.rate_bytes_per_s,
            "bf16_sample": None if st.sample is None else _sample_json(st.sample),
            "samples": {name: _sample_json(s) for name, s in st.samples.items()},
        }


def _sample_json(sample: CodecSample) -> dict[str, float]:
    return {
        "ratio": sample.ratio,
        "compress_gb_per_s": sample.compress_gb_per_s,
        "decompress_gb_per_s": sample.decompress_gb_per_s,
    }
