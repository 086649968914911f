"""The decoder under 100,000+ mutated and random frames: only typed errors, bounded buffering.

Any exception other than a ``WireError`` escapes ``FrameFuzzer.feed_one`` and fails the test; the
pytest timeout catches a hang. The fuzzer is seeded, so a failure reproduces.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.wire import HEADER_BYTES, Decoder, WireError, encode
from pddlink.wire.fuzz import FrameFuzzer, corpus, fix_crcs

LIMIT = 1 << 20


@pytest.mark.timeout(120)
def test_100k_mutated_frames_raise_only_typed_errors() -> None:
    fuzzer = FrameFuzzer(seed=20261129, max_body_bytes=LIMIT, max_payload_bytes=LIMIT)
    report = fuzzer.run(100_000)
    assert report.frames == 100_000
    # every layer was reached: framing, CRCs, header checks, body decoding, and valid frames
    for name in ("BadMagic", "BadChecksum", "FrameTooLarge", "UnknownMessageType", "MalformedMessage"):
        assert report.errors[name] > 100, (name, report.errors)
    assert report.messages > 5_000
    assert report.max_buffered_bytes <= HEADER_BYTES + 2 * LIMIT


def test_decoder_memory_stays_bounded_on_a_long_garbage_stream() -> None:
    fuzzer = FrameFuzzer(seed=7, max_body_bytes=LIMIT, max_payload_bytes=LIMIT)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        fuzzer.run(2_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 8 * LIMIT  # no frame may hold more than its limits, whatever its header says


def test_one_decoder_over_a_long_valid_stream_keeps_no_backlog() -> None:
    frames = [encode(m) for m in corpus()]
    rng = random.Random(3)
    stream = b"".join(rng.choice(frames) for _ in range(3_000))
    dec = Decoder()
    pos = count = 0
    while pos < len(stream):
        step = rng.randint(1, 300)
        count += len(dec.feed(stream[pos : pos + step]))
        assert dec.buffered_bytes < 4096
        pos += step
    assert count == 3_000 and dec.buffered_bytes == 0


def test_a_header_announcing_a_huge_payload_reserves_nothing() -> None:
    frame = bytearray(encode(corpus()[7]))  # a chunk
    frame[20:24] = (LIMIT - 1).to_bytes(4, "little")
    dec = Decoder(max_payload_bytes=LIMIT)
    assert dec.feed(bytes(fix_crcs(frame))) == []
    assert not dec.failed and dec.buffered_bytes < 2048


def test_truncated_stream_waits_instead_of_failing() -> None:
    frame = encode(corpus()[0])
    dec = Decoder()
    assert dec.feed(frame[:-1]) == []
    assert not dec.failed
    with pytest.raises(WireError):
        dec.feed(b"\x00" * 64 + frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 50))
def test_arbitrary_bytes_give_messages_or_a_typed_error(data: bytes, step: int) -> None:
    dec = Decoder(max_body_bytes=LIMIT, max_payload_bytes=LIMIT)
    try:
        for pos in range(0, len(data), step):
            dec.feed(b"PDLK" + data[pos : pos + step] if pos == 0 else data[pos : pos + step])
    except WireError:
        assert dec.failed
    assert dec.buffered_bytes <= HEADER_BYTES + 2 * LIMIT
