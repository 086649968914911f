"""The lossless KV codec: byte planes, frames, corrupt input, the skip policy, the thread pool."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.errors import ConfigError, InvalidInput
from pddlink.kv import planes
from pddlink.kv.codec import (
    HEADER,
    MAX_CHUNK_BYTES,
    CodecId,
    CorruptFrame,
    KVDtype,
    ParallelCodec,
    UnsupportedFrame,
    decode_chunk,
    encode_chunk,
    frame_info,
    iter_chunks,
)
from pddlink.kv.codec_policy import (
    CodecPolicy,
    CodecSample,
    LinkCodecChooser,
    measure_sample,
    synthetic_kv,
)

DTYPES = [d.name for d in KVDtype]


def gaussian_bf16(n_values: int, seed: int = 0) -> bytes:
    draws = np.random.default_rng(seed).standard_normal(n_values).astype(np.float32) * 0.5
    return (draws.view(np.uint32) >> 16).astype("<u2").tobytes()


def special_values_16bit() -> bytes:
    """Every special bf16/fp16 pattern family: ±0, ±inf, NaNs with payloads, denormals, extremes."""
    bf16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x7F7F, 0xFF7F]
    fp16 = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x0001, 0x83FF, 0x7BFF, 0x0400]
    return np.array(bf16 + fp16, dtype="<u2").tobytes()


# ---------------------------------------------------------------- byte planes


def _mantissa(parts: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.concatenate(parts)


def test_planes_round_trip_every_16_bit_pattern() -> None:
    words = np.arange(65536, dtype="<u2")
    high, low = planes.split(words.tobytes())
    assert np.array_equal(planes.merge(high, _mantissa(low)), words)


def test_planes_round_trip_every_fp32_sign_and_exponent_with_any_mantissa() -> None:
    rng = np.random.default_rng(4)
    top = np.arange(512, dtype=np.uint32) << np.uint32(23)  # sign and exponent: all 512 patterns
    words = (top[:, None] | rng.integers(0, 1 << 23, (512, 64), dtype=np.uint32)).reshape(-1)
    words = np.concatenate([words, top, top | np.uint32(0x7FFFFF)]).astype("<u4")
    high, low = planes.split(words.tobytes(), 4)
    assert high.size == words.size and sum(p.size for p in low) == 3 * words.size
    assert np.array_equal(planes.merge(high, _mantissa(low), 4), words)


def test_exponent_plane_is_exactly_the_bf16_exponent() -> None:
    values = np.array([1.0, -1.0, 2.0, -0.5, 3.0e38], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2")
    high, low = planes.split(bf16.tobytes())
    assert high.tolist() == [127, 127, 128, 126, 254]
    assert [int(b) & 1 for b in low[0]] == [0, 1, 0, 1, 0]  # the sign moved to the mantissa plane


def test_fp32_planes_golden_layout() -> None:
    # 1.0 = 0x3F800000, -2.0 = 0xC0000000, 1.5 + 2**-23 = 0x3FC00001; rotated left by one bit:
    # 0x7F000000, 0x80000001, 0x7F800002 -> exponents 127, 128, 127; the mantissa plane is the low
    # 16 bits of each rotated word (little endian), then each one's bits 16-23.
    values = np.array([1.0, -2.0, np.nextafter(np.float32(1.5), np.float32(2))], dtype="<f4")
    high, low = planes.split(values.tobytes(), 4)
    assert high.tolist() == [127, 128, 127]
    assert _mantissa(low).tobytes() == bytes([0, 0, 1, 0, 2, 0]) + bytes([0, 0, 0x80])


def test_planes_refuse_odd_length_and_mismatched_planes() -> None:
    with pytest.raises(InvalidInput):
        planes.split(b"\x00\x01\x02")
    with pytest.raises(InvalidInput):
        planes.split(b"\x00\x01\x02\x03\x04\x05", 4)
    with pytest.raises(InvalidInput):
        planes.split(b"\x00" * 8, 8)
    with pytest.raises(InvalidInput):
        planes.merge(b"\x00\x01", b"\x00")
    with pytest.raises(InvalidInput):
        planes.merge(b"\x00\x01", b"\x00\x01", 4)


# ---------------------------------------------------------------- lossless round trips


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), data=st.data(), compress=st.booleans())
def test_any_bytes_round_trip_for_every_dtype(dtype: str, data: st.DataObject, compress: bool) -> None:
    itemsize = KVDtype[dtype].itemsize
    n_items = data.draw(st.integers(0, 2048))
    raw = data.draw(st.binary(min_size=n_items * itemsize, max_size=n_items * itemsize))
    assert decode_chunk(encode_chunk(raw, dtype, compress=compress)) == raw


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), max_size=512
    ),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
)
def test_float_values_incl_nan_inf_denormals_round_trip(values: list[float], dtype: str) -> None:
    f32 = np.array(values, dtype=np.float32)
    if dtype == "float32":
        specials = np.array(
            [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 1, 0x807FFFFF],
            dtype="<u4",
        )
        raw = f32.astype("<f4").tobytes() + specials.tobytes()
        assert decode_chunk(encode_chunk(raw, dtype)) == raw
        return
    if dtype == "bfloat16":
        words = (f32.view(np.uint32) >> 16).astype("<u2")
    else:
        with np.errstate(over="ignore"):
            words = f32.astype(np.float16).view("<u2")
    raw = words.tobytes() + special_values_16bit()
    assert decode_chunk(encode_chunk(raw, dtype)) == raw


def test_gaussian_bf16_compresses_with_planes_and_beats_plain_size() -> None:
    raw = gaussian_bf16(1 << 18)
    frame = encode_chunk(raw, "bfloat16")
    codec, dtype, length = frame_info(frame)
    assert (codec, dtype, length) == (CodecId.PLANES_ZSTD, KVDtype.bfloat16, len(raw))
    assert len(raw) / len(frame) > 1.35
    assert decode_chunk(frame) == raw


def gaussian_fp32(n_values: int, seed: int = 0) -> bytes:
    return (np.random.default_rng(seed).standard_normal(n_values).astype("<f4") * 0.5).tobytes()


def test_gaussian_fp32_compresses_its_exponent_plane_only() -> None:
    raw = gaussian_fp32(1 << 18)
    frame = encode_chunk(raw, "float32")
    assert frame_info(frame) == (CodecId.PLANES_ZSTD, KVDtype.float32, len(raw))
    assert 1.15 < len(raw) / len(frame) < 4 / 3  # at most the whole exponent byte saved
    assert decode_chunk(frame) == raw
    packed = struct.unpack_from("<I", frame, 12)[0]
    assert len(frame) == HEADER.size + packed + 3 * len(raw) // 4
    high, low = planes.split(raw, 4)
    body = frame[HEADER.size :]
    assert zstandard.ZstdDecompressor().decompress(body[:packed]) == high.tobytes()
    assert body[packed:] == _mantissa(low).tobytes()


def test_a_plane_frame_whose_body_fits_another_dtype_is_corrupt() -> None:
    frame = bytearray(encode_chunk(gaussian_fp32(4096), "float32"))
    frame[4] = KVDtype.bfloat16.wire_id  # same header, bf16's body rule: the lengths disagree
    with pytest.raises(CorruptFrame, match="disagrees"):
        decode_chunk(bytes(frame))


def test_incompressible_or_unplaned_data_travels_raw_with_only_the_header_added() -> None:
    noise = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    for dtype in ("bfloat16", "float8_e4m3fn", "int8", "float32"):
        frame = encode_chunk(noise, dtype)
        assert frame_info(frame)[0] is CodecId.RAW
        assert len(frame) == len(noise) + HEADER.size
    assert frame_info(encode_chunk(gaussian_bf16(4096), "bfloat16", compress=False))[0] is CodecId.RAW


def test_raw_frame_golden_bytes() -> None:
    frame = encode_chunk(b"\x01\x02\x03\x04", "float16", compress=False)
    prefix = b"KC\x01\x00\x02\x00\x00\x00" + struct.pack("<II", 4, 0)
    digest = xxhash.xxh3_64_intdigest(prefix + b"\x01\x02\x03\x04")
    assert frame == prefix + struct.pack("<Q", digest) + b"\x01\x02\x03\x04"


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(InvalidInput, match="whole number"):
        encode_chunk(b"\x00\x01\x02", "bfloat16")
    with pytest.raises(InvalidInput, match="unknown KV dtype"):
        encode_chunk(b"\x00\x01", "bfloat17")


# ---------------------------------------------------------------- corrupt frames


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_bit_flip_is_a_typed_error(data: st.DataObject) -> None:
    raw = gaussian_bf16(2048, seed=data.draw(st.integers(0, 3)))
    dtype = data.draw(st.sampled_from(["bfloat16", "float32"]))
    frame = bytearray(encode_chunk(gaussian_fp32(1024) if dtype == "float32" else raw, dtype))
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptFrame):
        decode_chunk(bytes(frame))


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(max_size=256), keep=st.integers(0, 400))
def test_truncated_extended_or_random_frames_are_typed_errors(junk: bytes, keep: int) -> None:
    frame = encode_chunk(gaussian_bf16(128), "bfloat16")
    for bad in (frame[:keep], frame + junk[:1] if junk else frame[:-1], junk):
        if bad == frame:
            continue
        with pytest.raises(CorruptFrame):
            decode_chunk(bad)


def test_unknown_version_codec_or_dtype_is_unsupported() -> None:
    frame = encode_chunk(gaussian_bf16(64), "bfloat16")
    for offset, value in ((2, 9), (3, 7), (4, 99)):  # version, codec id, dtype id
        bad = bytearray(frame)
        bad[offset] = value
        with pytest.raises(UnsupportedFrame):
            decode_chunk(bytes(bad))


def test_frame_claiming_a_huge_chunk_is_refused_before_allocating() -> None:
    header = HEADER.pack(b"KC", 1, CodecId.RAW, KVDtype.bfloat16.wire_id, 0, 0, MAX_CHUNK_BYTES + 2, 0, 0)
    with pytest.raises(CorruptFrame, match="claims"):
        decode_chunk(header)


# ---------------------------------------------------------------- policy


SAMPLE = CodecSample(KVDtype.bfloat16, 1 << 20, ratio=1.5, compress_gb_per_s=0.6)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8", "float64"])
def test_policy_skips_dtypes_the_codec_cannot_shrink(dtype: str) -> None:
    assert CodecPolicy().choose(dtype, 1.0, SAMPLE).codec is CodecId.RAW


def test_policy_compresses_over_a_slow_link_and_skips_a_poor_ratio_or_no_sample() -> None:
    policy = CodecPolicy()
    assert policy.choose("bfloat16", 1.0, SAMPLE).codec is CodecId.PLANES_ZSTD
    poor = CodecSample(KVDtype.float16, 1 << 20, ratio=1.05, compress_gb_per_s=0.6)
    assert "ratio" in policy.choose("float16", 1.0, poor).reason
    assert policy.choose("float16", 1.0, poor).codec is CodecId.RAW
    assert policy.choose("bfloat16", 1.0, None).codec is CodecId.RAW


def test_policy_prices_fp32_with_its_own_lower_ratio() -> None:
    fp32 = CodecSample(KVDtype.float32, 1 << 20, ratio=1.2, compress_gb_per_s=0.8, decompress_gb_per_s=1.0)
    serial = CodecPolicy(pipelined=False)
    assert serial.choose("float32", 0.1, fp32).codec is CodecId.PLANES_ZSTD  # 100 Mbit/s: pays
    assert serial.choose("float32", 2.0, fp32).codec is CodecId.RAW  # 2 Gbit/s: compress+decompress cost more
    assert serial.choose("float32", 0.1, replace(fp32, ratio=1.05)).codec is CodecId.RAW


def test_link_chooser_measures_fp32_at_start_and_follows_it_apart_from_bf16() -> None:
    chooser = LinkCodecChooser(CodecPolicy(pipelined=False))
    bf16 = chooser.measure_at_start("bfloat16", sample_bytes=256 << 10)
    fp32 = chooser.measure_at_start("float32", sample_bytes=256 << 10)
    assert 1.15 < fp32.ratio < bf16.ratio
    assert chooser.choose("float32", 2e6).codec is CodecId.PLANES_ZSTD  # 16 Mbit/s
    assert chooser.choose("float32", 1e12).codec is CodecId.RAW
    for _ in range(20):
        chooser.observe("float32", 1000, 1000)
    assert chooser.choose("float32", 2e6).codec is CodecId.RAW
    assert chooser.choose("bfloat16", 2e6).codec is CodecId.PLANES_ZSTD


def test_policy_skips_a_link_faster_than_the_compressor_unless_threads_keep_up() -> None:
    # 6 Gbit/s = 0.75 GB/s of raw KV; one 0.6 GB/s thread would slow it down, two would not.
    assert CodecPolicy(threads=1).choose("bfloat16", 6.0, SAMPLE).codec is CodecId.RAW
    assert CodecPolicy(threads=2).choose("bfloat16", 6.0, SAMPLE).codec is CodecId.PLANES_ZSTD
    assert CodecPolicy(threads=8).choose("bfloat16", 100.0, SAMPLE).codec is CodecId.RAW


def test_policy_config_is_validated() -> None:
    for kwargs in ({"min_ratio": 0.9}, {"threads": 0}, {"min_speedup": 0.5}):
        with pytest.raises(ConfigError):
            CodecPolicy(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        CodecPolicy().choose("bfloat16", 0.0, SAMPLE)


def test_measure_sample_uses_the_injected_clock() -> None:
    ticks = iter([10.0, 10.5, 10.75])
    sample = measure_sample(
        gaussian_bf16(1 << 20), "bfloat16", sample_bytes=1 << 20, clock=lambda: next(ticks)
    )
    assert sample.sample_bytes == 1 << 20
    assert sample.compress_gb_per_s == pytest.approx((1 << 20) / 0.5 / 1e9)
    assert sample.decompress_gb_per_s == pytest.approx((1 << 20) / 0.25 / 1e9)
    assert sample.ratio > 1.35


def test_unpipelined_policy_pays_compress_wire_and_decompress_in_series() -> None:
    # 0.6 GB/s each way, ratio 1.5: in series 1/0.6 + 1/(L*1.5) + 1/0.6 s per GB beats 1/L only
    # while L < 0.1 GB/s (0.8 Gbit/s); pipelined it pays up to 0.6 GB/s.
    sample = CodecSample(KVDtype.bfloat16, 1 << 20, 1.5, 0.6, 0.6)
    serial, piped = CodecPolicy(pipelined=False, min_speedup=1.0), CodecPolicy(min_speedup=1.0)
    assert serial.choose("bfloat16", 0.5, sample).codec is CodecId.PLANES_ZSTD
    assert serial.choose("bfloat16", 1.0, sample).codec is CodecId.RAW
    assert piped.choose("bfloat16", 1.0, sample).codec is CodecId.PLANES_ZSTD
    assert serial.coded_gb_per_s(0.05, sample) == pytest.approx(1 / (2 / 0.6 + 1 / 0.075))


def test_link_chooser_measures_at_start_then_follows_achieved_ratios() -> None:
    chooser = LinkCodecChooser(CodecPolicy(pipelined=False))
    assert chooser.choose("bfloat16", None).reason == "link rate not measured yet"
    assert chooser.choose("bfloat16", 2e6).reason == "no codec sample measured yet"
    sample = chooser.measure_at_start("bfloat16", sample_bytes=256 << 10)
    assert sample.ratio > 1.3 and sample.compress_gb_per_s > 0
    assert chooser.choose("bfloat16", 2e6).codec is CodecId.PLANES_ZSTD  # 16 Mbit/s: slower than zstd
    assert chooser.choose("bfloat16", 1e12).codec is CodecId.RAW  # 8 Tbit/s: faster than any thread
    assert chooser.choose("float64", 2e6).codec is CodecId.RAW
    speed = chooser.samples[KVDtype.bfloat16].compress_gb_per_s
    chooser.observe("bfloat16", 10**9, 6 * 10**8, compress_s=0.5)  # 2 GB/s on its one thread
    assert chooser.samples[KVDtype.bfloat16].compress_gb_per_s == pytest.approx(0.7 * speed + 0.3 * 2.0)
    for _ in range(20):  # real KV turns out incompressible: the chooser stops compressing
        chooser.observe("bfloat16", 1000, 1000)
    assert chooser.samples[KVDtype.bfloat16].ratio < 1.01
    assert chooser.choose("bfloat16", 2e6).codec is CodecId.RAW


def test_link_chooser_samples_the_first_real_kv_of_a_dtype() -> None:
    chooser = LinkCodecChooser(CodecPolicy())
    decision = chooser.choose("float16", 2e6, gaussian_bf16(256 << 10, seed=3))
    assert KVDtype.float16 in chooser.samples and decision.reason


def test_synthetic_kv_is_gaussian_in_each_codable_dtype() -> None:
    data = np.frombuffer(synthetic_kv("bfloat16", 1 << 16), dtype="<u2")
    values = (data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    assert abs(float(values.std()) - 1.0) < 0.05
    fp32 = np.frombuffer(synthetic_kv("float32", 1 << 16), dtype="<f4")
    assert fp32.size == 1 << 14 and abs(float(fp32.std()) - 1.0) < 0.05
    with pytest.raises(InvalidInput):
        synthetic_kv("float64", 64)


# ---------------------------------------------------------------- chunks and the thread pool


def test_iter_chunks_are_zero_copy_and_item_aligned() -> None:
    data = bytes(range(256)) * 41
    chunks = list(iter_chunks(data, 1001, itemsize=4))
    assert all(len(c) == 1000 for c in chunks[:-1])
    assert b"".join(chunks) == data
    with pytest.raises(InvalidInput):
        list(iter_chunks(data, 3, itemsize=4))


def test_parallel_codec_keeps_order_and_matches_serial_frames() -> None:
    data = gaussian_bf16(1 << 18, seed=5)
    chunks = list(iter_chunks(data, 64 << 10, itemsize=2))
    serial = [encode_chunk(c, "bfloat16") for c in chunks]
    with ParallelCodec(3, lookahead=2) as pool:
        assert list(pool.imap_encode(iter(chunks), "bfloat16")) == serial
        assert pool.encode_all(chunks, "bfloat16") == serial
        assert b"".join(pool.decode_all(serial)) == data
    with pytest.raises(InvalidInput):
        ParallelCodec(0)
