"""Frames and messages: golden bytes, round-trips, stream splitting, typed errors, handoff size.

The golden hex below is the wire format: a change to it breaks every deployed peer, so these tests
fail on any change to a header, a field order or an encoding (update them only with a new
WIRE_VERSION).
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pddlink.errors import ErrorCode, InvalidInput, PddlinkError
from pddlink.kv.codec import CodecId
from pddlink.wire import (
    HEADER_BYTES,
    MESSAGE_TYPES,
    WIRE_VERSION,
    Abort,
    Ack,
    BadChecksum,
    BadFlags,
    BadMagic,
    ChannelRole,
    Chunk,
    Decoder,
    DecoderBroken,
    Encoder,
    Error,
    FrameTooLarge,
    Handoff,
    HandoffMode,
    Hello,
    HelloAccept,
    HelloRefuse,
    IndexEvent,
    IndexEventKind,
    IndexEvents,
    IndexSnapshot,
    IndexSnapshotRequest,
    KVLayoutSpec,
    MalformedMessage,
    PathMtu,
    Ping,
    Pong,
    RdmaCredit,
    RdmaDecline,
    RdmaEndpoint,
    RdmaReady,
    RdmaSetup,
    Release,
    Reserve,
    ReserveAnswer,
    Resume,
    TransferBegin,
    TransferEnd,
    UnknownMessageType,
    VersionMismatch,
    WireError,
    WireMessage,
    encode,
    encode_parts,
)
from pddlink.wire.fields import (
    F64,
    U128,
    Bool,
    CodedEnum,
    EnumOf,
    FixedBytes,
    ListOf,
    Optional,
    Payload,
    Str,
    StructOf,
    SVarint,
    U128List,
    UVarint,
)

L = KVLayoutSpec("m", 2, 4, 64, "bfloat16", 16)
SAMPLES: dict[str, WireMessage] = {
    "Hello": Hello("p-a", "p", 1, 1, ("zstd",)),
    "HelloAccept": HelloAccept("md-b", "md", 1, 1, ("zstd",)),
    "HelloRefuse": HelloRefuse(ErrorCode.VERSION_MISMATCH, "v2", 1),
    "Ping": Ping(7, 1000),
    "Pong": Pong(7, 1000, 2000),
    "Error": Error(ErrorCode.PROTOCOL, "bad", "r1"),
    "TransferBegin": TransferBegin(
        5, 0, "r1", L, 2, 40, (1, 2**128 - 1), CodecId.PLANES_ZSTD, 3000, 1024, 1500
    ),
    "Chunk": Chunk(5, 1, 2, 2048, 0xDEADBEEF, b"abc"),
    "Ack": Ack(5, 1, 3, (5, 6), (4,)),
    "Resume": Resume(5, 2, 3, (5,)),
    "TransferEnd": TransferEnd(5, 2, 3, 2**127 + 1),
    "Abort": Abort(5, 2, ErrorCode.DEADLINE_EXCEEDED, "late"),
    "Handoff": Handoff(
        "r1", 100, (5, 300, 70000), 42, 0.5, 40, 0.75, 256, (2,), HandoffMode.CATCH_UP, 1, False
    ),
    "IndexEvents": IndexEvents(
        3, (IndexEvent(1, IndexEventKind.STORED, 0, (9,)), IndexEvent(2, IndexEventKind.CLEARED))
    ),
    "IndexSnapshotRequest": IndexSnapshotRequest(3, 10),
    "IndexSnapshot": IndexSnapshot(3, 10, b"snap"),
    "Reserve": Reserve("r1", (1, 2), 500),
    "ReserveAnswer": ReserveAnswer("r1", 9, 2, 500),
    "Release": Release(9),
    "RdmaSetup": RdmaSetup(
        RdmaEndpoint(
            ChannelRole.RECEIVER,
            0x1234,
            77,
            3,
            1,
            PathMtu.MTU_1024,
            bytes(range(16)),
            0xABCD,
            1 << 40,
            16,
            4 << 20,
        )
    ),
    "RdmaReady": RdmaReady(),
    "RdmaDecline": RdmaDecline(ErrorCode.UNAVAILABLE, "no dev"),
    "RdmaCredit": RdmaCredit((0, 1, 300)),
}

# header (32 bytes) on the first line, then the body and payload
GOLDEN = {
    "Hello": ("50444c4b0301000000000000000000000e0000000000000090ea3318239a70f803702d610170010101047a737464"),
    "HelloAccept": (
        "50444c4b0302000000000000000000001000000000000000b7feb259dbd9356e046d642d62026d64010101047a737464"
    ),
    "HelloRefuse": ("50444c4b0303000000000000000000000500000000000000f31ce0dc3e2ab2ca0202763201"),
    "Ping": ("50444c4b0304000000000000000000000300000000000000d023cdf22de27a3207e807"),
    "Pong": ("50444c4b0305000000000000000000000500000000000000d18c0173d5fb5cd107e807d00f"),
    "Error": ("50444c4b0306000000000000000000000800000000000000b29a1982fa1e8f400103626164027231"),
    "TransferBegin": (
        "50444c4b0310000005000000000000003d00000000000000bcfd49516b0f1103"
        "00027231016d0204400862666c6f617431361002280200000000000000000000000000000001ffffffffffff"
        "ffffffffffffffffffff01b8178008dc0b"
    ),
    "Chunk": ("50444c4b03110000050000000000000009000000030000006a9ab6307b78f4e601028010effdb6f50d616263"),
    "Ack": ("50444c4b0312000005000000000000000700000000000000dc8c6aeae6ea969c01030205060104"),
    "Resume": ("50444c4b0313000005000000000000000400000000000000006c7ae00cff0c1f02030105"),
    "TransferEnd": (
        "50444c4b0314000005000000000000001200000000000000fbed8572b5c025b6020301000000000000000000000000000080"
    ),
    "Abort": ("50444c4b0315000005000000000000000700000000000000034b4467f3adf6980206046c617465"),
    "Handoff": (
        "50444c4b03200000000000000000000024000000000000001fba26e4089fd8c9"
        "027231640305ac02f0a2042a000000000000e03f28000000000000e83f80020102020100"
    ),
    "IndexEvents": (
        "50444c4b0330000000000000000000003800000000000000150cf33dd580966c"
        "0302010100000000000000000000000000000000010000000000000000000000000000000902030000000000"
        "000000000000000000000000"
    ),
    "IndexSnapshotRequest": ("50444c4b033100000000000000000000020000000000000022a8218a72007d5c030a"),
    "IndexSnapshot": ("50444c4b033200000000000000000000020000000400000022a8218ab537d2ae030a736e6170"),
    "Reserve": (
        "50444c4b0340000000000000000000002600000000000000efa3fc6371a156bf"
        "027231020000000000000000000000000000000100000000000000000000000000000002f403"
    ),
    "ReserveAnswer": ("50444c4b03410000000000000000000009000000000000002239137e2b87c3800272310902f4030000"),
    "Release": ("50444c4b03420000000000000000000001000000000000002957deab9b268fed09"),
    "RdmaSetup": (
        "50444c4b035000000000000000000000250000000000000002896512e7dff45f"
        "02b4244d030103000102030405060708090a0b0c0d0e0fcdd7028080808080201080808002"
    ),
    "RdmaReady": ("50444c4b035100000000000000000000000000000000000000000000f59fcbeb"),
    "RdmaDecline": ("50444c4b035200000000000000000000080000000000000060f14eb8e76742bf0f066e6f20646576"),
    "RdmaCredit": ("50444c4b03530000000000000000000005000000000000003375fc6c3a4557d2030001ac02"),
}


def decode_all(data: bytes, **limits: int) -> list[WireMessage]:
    return Decoder(**limits).feed(data)


# --- golden bytes -----------------------------------------------------------------------------


def test_every_message_type_has_a_golden_sample() -> None:
    assert {type(m) for m in SAMPLES.values()} == set(MESSAGE_TYPES.values())
    assert set(GOLDEN) == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name: str) -> None:
    msg = SAMPLES[name]
    assert encode(msg).hex() == GOLDEN[name]
    assert decode_all(bytes.fromhex(GOLDEN[name])) == [msg]


def test_header_layout() -> None:
    frame = bytes.fromhex(GOLDEN["Chunk"])
    assert frame[:4] == b"PDLK" and frame[4] == WIRE_VERSION == 3 and frame[5] == 0x11
    assert int.from_bytes(frame[8:16], "little") == 5  # transfer id rides in the header
    assert int.from_bytes(frame[20:24], "little") == 3  # payload length
    assert len(frame) == HEADER_BYTES + int.from_bytes(frame[16:20], "little") + 3


# --- round trips --------------------------------------------------------------------------------


def _strategy(codec: Any) -> st.SearchStrategy[Any]:
    if isinstance(codec, UVarint):
        return st.integers(0, codec.max)
    if isinstance(codec, SVarint):
        return st.integers(-(2**63), 2**63 - 1)
    if isinstance(codec, Bool):
        return st.booleans()
    if isinstance(codec, F64):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(codec, Str):
        return st.text(max_size=min(codec.max_bytes // 4, 40))
    if isinstance(codec, U128):
        return st.integers(0, 2**128 - 1)
    if isinstance(codec, U128List):
        return st.lists(st.integers(0, 2**128 - 1), max_size=6)
    if isinstance(codec, ListOf):
        return st.lists(_strategy(codec.item), max_size=6)
    if isinstance(codec, EnumOf):
        return st.sampled_from(list(codec.enum))
    if isinstance(codec, CodedEnum):
        return st.sampled_from(list(codec.codes))
    if isinstance(codec, Optional):
        return st.none() | _strategy(codec.inner)
    if isinstance(codec, StructOf):
        return _message_strategy(codec.cls)
    if isinstance(codec, Payload):
        return st.binary(max_size=2000)
    if isinstance(codec, FixedBytes):
        return st.binary(min_size=codec.size, max_size=codec.size)
    raise AssertionError(f"no strategy for {codec!r}")


OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "KVLayoutSpec.num_layers": st.integers(1, 200),
    "KVLayoutSpec.num_kv_heads": st.integers(1, 200),
    "KVLayoutSpec.head_dim": st.integers(1, 512),
    "KVLayoutSpec.block_size": st.integers(1, 512),
    # >= 512 so that any total_bytes below 2**40 fits the 2**32 - 1 chunk limit (checked on build)
    "TransferBegin.chunk_bytes": st.integers(512, 2**32 - 1),
    "TransferBegin.total_bytes": st.integers(0, 2**40),
}


def _message_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    fields = {
        name: OVERRIDES.get(f"{cls.__name__}.{name}", _strategy(codec)) for name, codec in cls.WIRE_FIELDS
    }
    if cls in (Ack, Resume):
        fields["next_index"] = st.integers(0, 2**31)
        fields["received"] = st.just(())
    if cls is IndexEvents:
        fields["events"] = st.lists(_message_strategy(IndexEvent), max_size=4).map(
            lambda evs: tuple(IndexEvent(i, e.kind, e.parent_hash, e.block_hashes) for i, e in enumerate(evs))
        )
    if cls is ReserveAnswer:
        fields["code"] = st.none()
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


ANY_MESSAGE = st.one_of([_message_strategy(cls) for cls in MESSAGE_TYPES.values()])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_MESSAGE)
def test_round_trip(msg: WireMessage) -> None:
    assert decode_all(encode(msg)) == [msg]


@settings(max_examples=150, deadline=None)
@given(st.lists(ANY_MESSAGE, min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_stream_split_anywhere_gives_the_same_messages(msgs: list[WireMessage], rnd: random.Random) -> None:
    stream = b"".join(encode(m) for m in msgs)
    assert decode_all(stream) == msgs
    byte_by_byte = Decoder()
    got: list[WireMessage] = []
    for i in range(len(stream)):
        got += byte_by_byte.feed(stream[i : i + 1])
    assert got == msgs
    cuts = sorted(rnd.sample(range(len(stream) + 1), min(len(stream) + 1, rnd.randint(0, 8))))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    split = Decoder()
    got = []
    for piece in pieces:
        got += split.feed(bytearray(piece))
    assert got == msgs
    assert split.buffered_bytes == 0


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_byte_by_byte(name: str) -> None:
    frame = bytes.fromhex(GOLDEN[name]) * 2
    dec = Decoder()
    got: list[WireMessage] = []
    for b in frame:
        got += dec.feed(bytes([b]))
    assert got == [SAMPLES[name], SAMPLES[name]]


# --- zero copy -----------------------------------------------------------------------------------


def test_chunk_payload_is_not_copied_on_encode() -> None:
    data = bytearray(b"x" * 4096)
    view = memoryview(data)[1024:2048]
    chunk = Chunk(1, 0, 1, 1024, 0, view)
    head, payload = encode_parts(chunk)
    assert isinstance(payload, memoryview)
    data[1024] = ord("y")  # the payload still reads the caller's buffer
    assert bytes(payload[:1]) == b"y"
    assert len(head) == HEADER_BYTES + len(encode(chunk)) - HEADER_BYTES - 1024


def test_decoded_payload_is_a_readonly_view() -> None:
    (msg,) = decode_all(bytes.fromhex(GOLDEN["Chunk"]))
    assert isinstance(msg, Chunk) and isinstance(msg.payload, memoryview) and msg.payload.readonly


# --- handoff size --------------------------------------------------------------------------------


def test_handoff_of_100_tokens_fits_half_a_kilobyte() -> None:
    rng = random.Random(5)
    msg = Handoff(
        request_id="c0ffee00-1234-4bcd-9abc-0123456789ab",
        first_position=65_000,
        token_ids=tuple(rng.randrange(151_936) for _ in range(100)),  # a Qwen-size vocabulary
        seed=2**62 + 12345,
        temperature=0.7,
        top_k=50,
        top_p=0.95,
        max_tokens=4096,
        stop_token_ids=(151_643, 151_645),
        mode=HandoffMode.ONE_SHOT,
    )
    frame = encode(msg)
    assert len(frame) <= 500, len(frame)
    assert decode_all(frame) == [msg]


# --- typed errors -------------------------------------------------------------------------------


def _reframe(frame: bytes, *, header: dict[int, int] | None = None, body: bytes | None = None) -> bytes:
    """Rewrite header bytes and/or the body, then fix both CRCs (to reach the deeper checks)."""
    raw = bytearray(frame[:HEADER_BYTES])
    rest = frame[HEADER_BYTES:]
    if body is not None:
        raw[16:20] = len(body).to_bytes(4, "little")
        raw[24:28] = zlib.crc32(body).to_bytes(4, "little")
        rest = body
    for off, val in (header or {}).items():
        raw[off] = val
    raw[28:32] = zlib.crc32(bytes(raw[:28])).to_bytes(4, "little")
    return bytes(raw) + rest


PING = bytes.fromhex(GOLDEN["Ping"])


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"XDLK" + PING[4:], BadMagic),
        (PING[:28] + bytes([PING[28] ^ 1]) + PING[29:], BadChecksum),
        (PING[:-1] + bytes([PING[-1] ^ 1]), BadChecksum),
        (_reframe(PING, header={4: 9}), VersionMismatch),
        (_reframe(PING, header={5: 99}), UnknownMessageType),
        (_reframe(PING, header={6: 1}), BadFlags),
        (_reframe(PING, header={19: 0x7F}), FrameTooLarge),
        (_reframe(PING, header={23: 0x7F}), FrameTooLarge),
        (_reframe(PING, header={20: 1}), MalformedMessage),  # a ping with a payload
        (_reframe(PING, header={8: 1}), MalformedMessage),  # a ping with a stream id
        (_reframe(PING, body=b"\x07"), MalformedMessage),  # truncated
        (_reframe(PING, body=b"\x07\xe8\x07\x00"), MalformedMessage),  # trailing byte
        (_reframe(PING, body=b"\x07\x80\x00"), MalformedMessage),  # non-canonical varint
        (_reframe(PING, body=b"\xff" * 11), MalformedMessage),  # overlong varint
        (_reframe(bytes.fromhex(GOLDEN["Error"]), body=b"\x01\x02\xff\xfe\x00"), MalformedMessage),
        (
            _reframe(bytes.fromhex(GOLDEN["Handoff"]), header={4: WIRE_VERSION}, body=b"\x00"),
            MalformedMessage,
        ),
    ],
)
def test_bad_frames_raise_typed_errors(frame: bytes, error: type[WireError]) -> None:
    dec = Decoder(max_body_bytes=1 << 20, max_payload_bytes=1 << 20)
    with pytest.raises(error) as info:
        dec.feed(frame)
    assert info.value.code in (
        ErrorCode.PROTOCOL,
        ErrorCode.VERSION_MISMATCH,
        ErrorCode.INTEGRITY,
        ErrorCode.CAPACITY,
    )
    with pytest.raises(DecoderBroken):
        dec.feed(PING)


def test_messages_before_a_bad_frame_are_delivered_first() -> None:
    dec = Decoder()
    dec.receive_data(PING + b"garbage" + b"\x00" * 40)
    assert dec.next_message() == SAMPLES["Ping"]
    with pytest.raises(BadMagic):
        dec.next_message()
    with pytest.raises(BadMagic):
        dec.next_message()


def test_unknown_error_code_from_a_newer_peer_reads_as_unknown() -> None:
    frame = _reframe(bytes.fromhex(GOLDEN["Error"]), body=b"\x63\x01x\x00")
    assert decode_all(frame) == [Error(ErrorCode.UNKNOWN, "x")]


def test_transfer_begin_names_its_codec_and_an_unknown_codec_is_refused() -> None:
    frame = bytes.fromhex(GOLDEN["TransferBegin"])
    (begin,) = decode_all(frame)
    assert begin.codec is CodecId.PLANES_ZSTD
    body = frame[HEADER_BYTES:]
    at = body.rindex(bytes.fromhex("01b817"))  # codec 1, then total_bytes 3000
    assert decode_all(_reframe(frame, body=body[:at] + b"\x00" + body[at + 1 :]))[0].codec is CodecId.RAW
    with pytest.raises(MalformedMessage, match="CodecId"):
        decode_all(_reframe(frame, body=body[:at] + b"\x07" + body[at + 1 :]))


def test_hello_of_another_version_still_decodes() -> None:
    frame = _reframe(bytes.fromhex(GOLDEN["Hello"]), header={4: 7})
    (hello,) = decode_all(frame)
    assert isinstance(hello, Hello)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Ping(-1, 0),
        lambda: Ping(2**64, 0),
        lambda: Ping(True, 0),
        lambda: Hello("x" * 300, "p", 1, 1),
        lambda: Handoff("r", 0, (2**32,), 0, 0.0, 0, 1.0, 1),
        lambda: Handoff("r", 0, (1,), 0, float("nan"), 0, 1.0, 1),
        lambda: Ack(1, 0, 5, (3,)),
        lambda: IndexEvents(1, (IndexEvent(2, IndexEventKind.STORED), IndexEvent(2, IndexEventKind.STORED))),
        lambda: ReserveAnswer("r", 1, 2, 3, ErrorCode.CAPACITY, "full"),
        lambda: TransferBegin(1, 0, "r", L, 0, 0, (), 0, 10, 0, 0),
        lambda: KVLayoutSpec("m", 0, 1, 1, "bfloat16", 16),
        lambda: Chunk(1, 0, 0, 0, 0, "text"),
        lambda: Reserve("r", "not a list", 1),
    ],
)
def test_invalid_messages_are_refused_on_construction(build: Any) -> None:
    with pytest.raises(InvalidInput):
        build()


def test_lists_become_tuples() -> None:
    msg = Reserve("r", [1, 2], 5)
    assert msg.block_hashes == (1, 2)


def test_encoder_refuses_non_messages() -> None:
    with pytest.raises(PddlinkError):
        Encoder().encode(L)  # type: ignore[arg-type]


def test_refused_reserve_answer_round_trips() -> None:
    msg = ReserveAnswer("r", code=ErrorCode.CAPACITY, reason="DRC full")
    assert not msg.granted and decode_all(encode(msg)) == [msg]
