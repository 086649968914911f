"""A transfer's payload under a codec: round trip across chunk boundaries, and damage refused."""

from __future__ import annotations

import numpy as np
import pytest

from pddlink.errors import InvalidInput
from pddlink.kv.codec import CodecId, CorruptFrame, KVDtype, ParallelCodec, encode_chunk
from pddlink.kv.codec_policy import synthetic_kv
from pddlink.kv.payload import FRAME_BYTES, decode_payload, encode_payload, split_frames


def _chunks(data: memoryview, size: int) -> list[memoryview]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("threads", [0, 2])
def test_planes_payload_round_trips_across_chunks_that_cut_frames(threads: int) -> None:
    kv = synthetic_kv("bfloat16", 2 * FRAME_BYTES + 4096, seed=1)
    pool = ParallelCodec(threads) if threads else None
    try:
        wire = encode_payload(kv, "bfloat16", CodecId.PLANES_ZSTD, pool)
        assert len(split_frames(wire)) == 3
        assert len(wire) < len(kv) / 1.3
        for size in (4096, 333_333, len(wire)):  # chunk boundaries fall inside headers and bodies
            back = decode_payload(_chunks(wire, size), CodecId.PLANES_ZSTD, "bfloat16",
                                  expected_bytes=len(kv), pool=pool)  # fmt: skip
            assert bytes(back) == kv
    finally:
        if pool is not None:
            pool.close()


def test_raw_payload_is_the_kv_itself_without_a_copy() -> None:
    kv = bytearray(synthetic_kv("bfloat16", 8192))
    wire = encode_payload(kv, "bfloat16", CodecId.RAW)
    assert wire.obj is kv
    assert bytes(decode_payload(_chunks(wire, 1000), CodecId.RAW, "bfloat16", expected_bytes=8192)) == kv


def test_codec_refuses_dtypes_it_cannot_shrink() -> None:
    with pytest.raises(InvalidInput, match="float64"):
        encode_payload(np.zeros(16).tobytes(), "float64", CodecId.PLANES_ZSTD)


def test_damaged_or_mismatched_payloads_are_refused() -> None:
    kv = synthetic_kv("bfloat16", 3 * 4096)
    wire = bytes(encode_payload(kv, "bfloat16", CodecId.PLANES_ZSTD))
    with pytest.raises(CorruptFrame, match="payload decodes to"):
        decode_payload([wire], CodecId.PLANES_ZSTD, "bfloat16", expected_bytes=len(kv) + 2)
    with pytest.raises(CorruptFrame):
        decode_payload([wire[:-5]], CodecId.PLANES_ZSTD, "bfloat16")
    with pytest.raises(CorruptFrame):
        decode_payload([wire[:10]], CodecId.PLANES_ZSTD, "bfloat16")
    flipped = bytearray(wire)
    flipped[100] ^= 0x40
    with pytest.raises(CorruptFrame):
        decode_payload([bytes(flipped)], CodecId.PLANES_ZSTD, "bfloat16")
    fp16 = encode_chunk(kv, KVDtype.float16)
    with pytest.raises(CorruptFrame, match="float16 frame"):
        decode_payload([fp16], CodecId.PLANES_ZSTD, "bfloat16")
    with pytest.raises(CorruptFrame, match="payload decodes to"):
        decode_payload([kv], CodecId.RAW, "bfloat16", expected_bytes=1)
