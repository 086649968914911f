"""P's WAN codec decision, in memory: measured compressor, link rate from the model or from goodput."""

from __future__ import annotations

import pytest

from harness.demo_report import codec_summary
from pddlink.errors import ConfigError
from pddlink.kv.codec import CodecId
from pddlink.kv.codec_policy import synthetic_kv
from pddlink.transport import TransferResult
from sidecar.wan_codec import WanCodec

KV = memoryview(synthetic_kv("bfloat16", 64 << 10))


def test_a_slow_configured_line_compresses_bf16_and_a_fast_one_does_not() -> None:
    slow = WanCodec("auto", line_mbit=16.0, rtt_s=0.02)
    assert slow.decide("bfloat16", KV, 0.0).codec is CodecId.PLANES_ZSTD
    assert slow.decide("float64", KV, 0.0).codec is CodecId.RAW
    assert slow.decide("bf16", KV, 0.0).codec is CodecId.RAW  # a name the codec does not know: no codec
    fast = WanCodec("auto", line_mbit=1e7, rtt_s=0.0001)  # 10 Tbit/s: faster than any compressor thread
    assert fast.decide("bfloat16", KV, 0.0).codec is CodecId.RAW
    assert "outpaces" in fast.decide("bfloat16", KV, 0.0).reason


def test_fp32_kv_is_priced_with_its_own_sample_measured_at_start() -> None:
    fp32 = memoryview(synthetic_kv("float32", 64 << 10))
    slow = WanCodec("auto", line_mbit=16.0, rtt_s=0.02)
    assert slow.decide("float32", fp32, 0.0).codec is CodecId.PLANES_ZSTD
    samples = slow.status_json(0.0)["samples"]
    assert set(samples) == {"bfloat16", "float32"}
    assert 1.1 < samples["float32"]["ratio"] < samples["bfloat16"]["ratio"]
    fast = WanCodec("auto", line_mbit=1e7, rtt_s=0.0001)
    assert fast.decide("float32", fp32, 0.0).codec is CodecId.RAW


def test_without_a_line_rate_the_first_transfer_goes_raw_then_goodput_decides() -> None:
    codec = WanCodec("auto")
    first = codec.decide("bfloat16", KV, 0.0)
    assert first.codec is CodecId.RAW and "not measured" in first.reason
    codec.started("r1/1", len(KV), 0.0)
    codec.finished("r1/1", "bfloat16", TransferResult(1, len(KV), 1, seconds=0.05), 0.05)
    assert codec.rate_bytes_per_s(0.05) == pytest.approx(len(KV) / 0.05)  # ~10 Mbit/s measured
    assert codec.decide("bfloat16", KV, 0.1).codec is CodecId.PLANES_ZSTD


def test_fair_share_of_a_busy_line_and_achieved_ratios_feed_back() -> None:
    codec = WanCodec("auto", line_mbit=8000.0, rtt_s=0.001, pool_size=8)
    alone = codec.rate_bytes_per_s(0.0)
    for i in range(3):
        codec.started(f"r{i}", 10 << 20, 0.0)
    assert codec.rate_bytes_per_s(0.0) == pytest.approx(alone / 4)  # three flows ahead: a quarter each
    before = codec.chooser.samples[next(iter(codec.chooser.samples))].ratio
    done = TransferResult(1, 1000, 1, 0.01, codec=CodecId.PLANES_ZSTD, raw_bytes=1000)  # ratio 1.0
    codec.finished("r0", "bfloat16", done, 0.01)
    assert codec.chooser.samples[next(iter(codec.chooser.samples))].ratio < before


def test_forced_modes_and_bad_config() -> None:
    assert WanCodec("raw", line_mbit=1.0).decide("bfloat16", KV).codec is CodecId.RAW
    assert WanCodec("planes_zstd").decide("bfloat16", KV).codec is CodecId.PLANES_ZSTD
    assert WanCodec("planes_zstd").decide("float32", KV).codec is CodecId.PLANES_ZSTD
    assert WanCodec("planes_zstd").decide("float64", KV).codec is CodecId.RAW
    with pytest.raises(ConfigError):
        WanCodec("lz4")
    with pytest.raises(ConfigError):
        WanCodec("auto", line_mbit=-1)


def test_demo_codec_summary_from_counters() -> None:
    counters = {
        "codec_raw_wan_planes_zstd": 3000.0,
        "codec_wire_wan_planes_zstd": 2000.0,
        "codec_raw_wan_raw": 1000.0,
        "codec_wire_wan_raw": 1000.0,
        "kv_bytes_wan": 4000.0,
    }
    s = codec_summary(counters)
    assert s["name"] == "planes_zstd" and s["ratio"] == pytest.approx(4000 / 3000)
    assert s["bytes_saved"] == 1000 and s["by_codec"]["raw"]["kv_bytes"] == 1000
    assert codec_summary({}) == {
        "name": "raw", "ratio": 1.0, "bytes_saved": 0, "kv_bytes": 0, "wire_bytes": 0, "by_codec": {}
    }  # fmt: skip
