"""RDMA set-up: its messages (golden bytes, round trips, bad bytes) and the sans-I/O negotiation
between two in-memory sides whose messages cross as real frame bytes."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddlink.errors import ConfigError, DeadlineExceeded, ErrorCode, InvalidInput, RemoteError, Unavailable
from pddlink.wire import (
    HEADER_BYTES,
    ChannelRole,
    Decoder,
    Hello,
    MalformedMessage,
    PathMtu,
    Ping,
    RdmaCredit,
    RdmaDecline,
    RdmaEndpoint,
    RdmaReady,
    RdmaSetup,
    WireMessage,
    encode,
)
from pddlink.wire.frame import HEADER
from pddlink.wire.rdma_setup import (
    BadRdmaEndpoint,
    ConnectQueuePair,
    Fallback,
    FastPathSelected,
    LocalRdma,
    RdmaNegotiation,
    RdmaSetupOutOfOrder,
    SetupConfig,
    SetupEvent,
    SetupState,
)

GID = bytes.fromhex("fe800000000000000202c9fffe012345")
RECEIVER = RdmaEndpoint(
    ChannelRole.RECEIVER, 0x1234, 77, 3, 1, PathMtu.MTU_1024, GID, 0xABCD, 1 << 40, 16, 4 << 20
)
SENDER = RdmaEndpoint(ChannelRole.SENDER, 0x99, 5, 3, 1, PathMtu.MTU_4096, GID)

# --- messages -------------------------------------------------------------------------------------

GOLDEN = {  # the wire format: change only with a new wire version (type codes 80-83)
    RdmaSetup(RECEIVER): (
        "50444c4b03500000000000000000000025000000000000007d853de025d26344"
        "02b4244d030103fe800000000000000202c9fffe012345cdd7028080808080201080808002"
    ),
    RdmaReady(): "50444c4b035100000000000000000000000000000000000000000000f59fcbeb",
    RdmaDecline(ErrorCode.DEADLINE_EXCEEDED, "late"): (
        "50444c4b0352000000000000000000000600000000000000f72475dc46d0cb8b06046c617465"
    ),
    RdmaCredit((0, 15, 4095)): "50444c4b0353000000000000000000000500000000000000773af2940d17029003000fff1f",
}


@pytest.mark.parametrize("msg", list(GOLDEN), ids=lambda m: type(m).__name__)
def test_golden_bytes_whole_and_byte_by_byte(msg: WireMessage) -> None:
    frame = bytes.fromhex(GOLDEN[msg])
    assert encode(msg).hex() == GOLDEN[msg]
    assert Decoder().feed(frame) == [msg]
    dec, got = Decoder(), []
    for i in range(len(frame)):
        got += dec.feed(frame[i : i + 1])
    assert got == [msg]


ENDPOINTS = st.builds(
    RdmaEndpoint,
    role=st.sampled_from(ChannelRole),
    qp_num=st.integers(0, (1 << 24) - 1),
    psn=st.integers(0, (1 << 24) - 1),
    lid=st.integers(0, 0xFFFF),
    port_num=st.integers(0, 255),
    path_mtu=st.sampled_from(PathMtu),
    gid=st.binary(min_size=16, max_size=16),
    rkey=st.integers(0, (1 << 32) - 1),
    addr=st.integers(0, (1 << 64) - 1),
    slots=st.integers(0, 0xFFFF),
    slot_bytes=st.integers(0, (1 << 32) - 1),
)


@settings(max_examples=300, deadline=None)
@given(ENDPOINTS, st.lists(st.integers(0, 0xFFFF), max_size=40))
def test_round_trip(endpoint: RdmaEndpoint, slots: list[int]) -> None:
    for msg in (RdmaSetup(endpoint), RdmaCredit(tuple(slots))):
        assert Decoder().feed(encode(msg)) == [msg]
    assert bytes.fromhex(endpoint.gid_text.replace(":", "")) == endpoint.gid


def _reframe(frame: bytes, body: bytes) -> bytes:
    """The same header with a new body, both CRCs fixed: only the message decoder can object."""
    fields = list(HEADER.unpack(frame[:HEADER_BYTES]))
    fields[5], fields[7] = len(body), zlib.crc32(body)  # body_len, body_crc
    head = HEADER.pack(*fields)[:28]
    return head + zlib.crc32(head).to_bytes(4, "little") + body


@pytest.mark.parametrize(
    ("name", "mutate"),
    [
        ("unknown role", lambda b: b"\x03" + b[1:]),
        ("path mtu 6", lambda b: b[:6] + b"\x06" + b[7:]),
        ("gid cut short", lambda b: b[:20]),
        ("qp number above 24 bits", lambda b: b"\x02\x80\x80\x80\x08" + b[3:]),
        ("trailing byte", lambda b: b + b"\x00"),
    ],
)
def test_bad_endpoint_bytes_are_a_typed_error(name: str, mutate: object) -> None:
    frame = encode(RdmaSetup(RECEIVER))
    body = frame[HEADER_BYTES:]
    assert callable(mutate)
    bad = _reframe(frame, mutate(body))
    dec = Decoder()
    with pytest.raises(MalformedMessage):
        dec.feed(bad)
    assert dec.failed


def test_messages_validate_on_construction() -> None:
    with pytest.raises(InvalidInput, match="gid must be 16 bytes"):
        replace(SENDER, gid=b"\x00" * 15)
    with pytest.raises(InvalidInput, match="qp_num"):
        replace(SENDER, qp_num=1 << 24)
    with pytest.raises(InvalidInput, match="path_mtu"):
        replace(SENDER, path_mtu=7)
    with pytest.raises(InvalidInput, match="slots"):
        RdmaCredit((1 << 16,))
    assert RECEIVER.length == 64 << 20 and SENDER.length == 0


# --- negotiation ----------------------------------------------------------------------------------


def side(
    role: ChannelRole,
    *,
    offers: bool = True,
    local: LocalRdma | None = None,
    timeout_s: float = 5.0,
    min_slot_bytes: int = 1 << 20,
) -> RdmaNegotiation:
    endpoint = RECEIVER if role is ChannelRole.RECEIVER else SENDER
    return RdmaNegotiation(
        role,
        peer_offers=offers,
        local=local or LocalRdma(endpoint),
        now=0.0,
        config=SetupConfig(timeout_s=timeout_s, min_slot_bytes=min_slot_bytes),
    )


class Adapter:
    """What the asyncio glue does for one side: connect the queue pair when asked, keep events."""

    def __init__(self, machine: RdmaNegotiation, *, connect_fails: bool = False) -> None:
        self.machine = machine
        self.connect_fails = connect_fails
        self.events: list[SetupEvent] = []
        self.decoder = Decoder()

    def drain(self, now: float) -> None:
        while (event := self.machine.next_event()) is not None:
            self.events.append(event)
            if isinstance(event, ConnectQueuePair):
                if self.connect_fails:
                    self.machine.local_failed("modify QP to RTR failed: errno 22", now)
                else:
                    self.machine.endpoint_connected(now)

    @property
    def paths(self) -> list[str]:
        return [e.path for e in self.events if isinstance(e, FastPathSelected)]


def run(a: Adapter, b: Adapter, now: float = 0.0) -> list[WireMessage]:
    """Carry frames both ways until neither side has anything to send; returns what crossed."""
    crossed: list[WireMessage] = []
    for _ in range(10):
        moved = False
        for src, dst in ((a, b), (b, a)):
            src.drain(now)
            for msg in src.machine.messages_to_send():
                moved = True
                for got in dst.decoder.feed(encode(msg)):
                    crossed.append(got)
                    dst.machine.receive(got, now)
            dst.drain(now)
        if not moved:
            return crossed
    raise AssertionError("the set-up did not settle")


def test_both_offer_and_connect_then_rdma_on_both_sides() -> None:
    rx, tx = Adapter(side(ChannelRole.RECEIVER)), Adapter(side(ChannelRole.SENDER))
    crossed = run(rx, tx)
    assert [type(m) for m in crossed] == [RdmaSetup, RdmaSetup, RdmaReady]
    assert crossed[0] == RdmaSetup(RECEIVER) and crossed[1] == RdmaSetup(SENDER)
    assert rx.machine.state is tx.machine.state is SetupState.RDMA
    assert rx.paths == tx.paths == ["rdma"]
    assert tx.machine.peer_endpoint == RECEIVER and rx.machine.peer_endpoint == SENDER
    assert [e for e in tx.events if isinstance(e, ConnectQueuePair)] == [ConnectQueuePair(RECEIVER)]
    assert rx.machine.get_timer() is None and tx.machine.get_timer() is None and rx.machine.error is None


@pytest.mark.parametrize("lacking", [ChannelRole.RECEIVER, ChannelRole.SENDER])
def test_one_side_without_rdma_declines_and_both_use_tcp_with_its_reason(lacking: ChannelRole) -> None:
    reason = "RDMA fast path unavailable: no RDMA device"
    make = {r: side(r, local=LocalRdma.unavailable(reason) if r is lacking else None) for r in ChannelRole}
    rx, tx = Adapter(make[ChannelRole.RECEIVER]), Adapter(make[ChannelRole.SENDER])
    crossed = run(rx, tx)
    assert RdmaDecline(ErrorCode.UNAVAILABLE, reason) in crossed
    assert not any(isinstance(m, RdmaReady) for m in crossed)
    lacks, other = (rx, tx) if lacking is ChannelRole.RECEIVER else (tx, rx)
    assert lacks.paths == other.paths == ["tcp"]
    assert lacks.machine.outcome == FastPathSelected("tcp", Fallback.LOCAL_UNAVAILABLE, reason)
    assert other.machine.outcome is not None and other.machine.outcome.fallback is Fallback.PEER_DECLINED
    assert isinstance(other.machine.error, RemoteError) and reason in other.machine.error.message
    assert isinstance(lacks.machine.error, Unavailable)


def test_a_peer_that_does_not_offer_rdma_is_sent_nothing() -> None:
    m = side(ChannelRole.RECEIVER, offers=False)
    assert m.messages_to_send() == []
    assert m.outcome is not None and m.outcome.fallback is Fallback.PEER_NOT_OFFERED and m.path == "tcp"
    assert "rdma/1" in m.outcome.reason and m.get_timer() is None


def test_a_silent_peer_past_the_deadline_means_tcp_and_a_decline() -> None:
    tx = side(ChannelRole.SENDER, timeout_s=2.0)
    assert tx.get_timer() == 2.0
    tx.handle_timer(1.999)
    assert tx.state is SetupState.AWAIT_ENDPOINT and tx.messages_to_send() == []
    tx.handle_timer(2.0)
    assert tx.state is SetupState.TCP and tx.get_timer() is None
    assert tx.messages_to_send() == [
        RdmaDecline(ErrorCode.DEADLINE_EXCEEDED, tx.outcome.reason if tx.outcome else "")
    ]
    assert tx.outcome is not None and tx.outcome.fallback is Fallback.SETUP_TIMEOUT
    assert isinstance(tx.error, DeadlineExceeded) and "within 2.0 s" in tx.error.message
    tx.receive(RdmaSetup(RECEIVER), 3.0)  # late: ignored, the peer has our decline
    assert tx.state is SetupState.TCP and tx.next_event() == tx.outcome and tx.next_event() is None


def test_deadline_while_the_adapter_connects_wins_and_the_late_connect_is_ignored() -> None:
    tx = side(ChannelRole.SENDER, timeout_s=1.0)
    tx.receive(RdmaSetup(RECEIVER), 0.5)
    assert isinstance(tx.next_event(), ConnectQueuePair) and tx.state is SetupState.CONNECTING
    tx.handle_timer(1.0)
    tx.endpoint_connected(1.2)
    assert tx.state is SetupState.TCP and [type(m) for m in tx.messages_to_send()] == [RdmaDecline]


@pytest.mark.parametrize(
    ("peer", "words"),
    [
        (replace(RECEIVER, role=ChannelRole.SENDER, slots=0, slot_bytes=0, rkey=0, addr=0), "both ends"),
        (replace(RECEIVER, slots=0), "no landing slots"),
        (replace(RECEIVER, slot_bytes=4096), "cannot hold"),
    ],
)
def test_an_unusable_peer_endpoint_is_declined_with_a_typed_reason(peer: RdmaEndpoint, words: str) -> None:
    tx = side(ChannelRole.SENDER)
    tx.receive(RdmaSetup(peer), 0.1)
    assert tx.state is SetupState.TCP and isinstance(tx.error, BadRdmaEndpoint) and words in tx.error.message
    (decline,) = tx.messages_to_send()
    assert isinstance(decline, RdmaDecline) and decline.code is ErrorCode.BAD_REQUEST
    assert tx.outcome is not None and tx.outcome.fallback is Fallback.BAD_PEER_ENDPOINT
    assert not any(isinstance(e, ConnectQueuePair) for e in iter(tx.next_event, None))


def test_a_failed_queue_pair_connect_declines() -> None:
    rx, tx = Adapter(side(ChannelRole.RECEIVER)), Adapter(side(ChannelRole.SENDER), connect_fails=True)
    crossed = run(rx, tx)
    assert [type(m) for m in crossed] == [RdmaSetup, RdmaDecline]
    assert tx.machine.outcome is not None and tx.machine.outcome.fallback is Fallback.LOCAL_FAILED
    assert "errno 22" in tx.machine.outcome.reason and rx.paths == ["tcp"]


def test_messages_out_of_order_fall_back_with_a_protocol_reason() -> None:
    rx = side(ChannelRole.RECEIVER)
    rx.messages_to_send()
    rx.receive(RdmaReady(), 0.1)  # only a sender expects Ready
    assert isinstance(rx.error, RdmaSetupOutOfOrder) and rx.error.code is ErrorCode.PROTOCOL
    assert [m.code for m in rx.messages_to_send() if isinstance(m, RdmaDecline)] == [ErrorCode.PROTOCOL]


def test_a_decline_after_rdma_moves_the_link_to_tcp() -> None:
    rx, tx = Adapter(side(ChannelRole.RECEIVER)), Adapter(side(ChannelRole.SENDER))
    run(rx, tx)
    tx.machine.local_failed("work completion failed with status 12", 1.0)  # e.g. the NIC went away
    run(rx, tx, now=1.0)
    assert rx.paths == tx.paths == ["rdma", "tcp"]
    assert rx.machine.outcome is not None and "status 12" in rx.machine.outcome.reason


def test_bad_input_changes_nothing() -> None:
    tx = side(ChannelRole.SENDER)
    with pytest.raises(InvalidInput):
        tx.receive(Ping(1, 2), 0.0)
    with pytest.raises(InvalidInput):
        tx.endpoint_connected(0.0)  # nothing asked to connect
    assert tx.state is SetupState.AWAIT_ENDPOINT and tx.messages_to_send() == []
    with pytest.raises(InvalidInput, match="RECEIVER"):
        side(ChannelRole.SENDER, local=LocalRdma(RECEIVER))
    with pytest.raises(InvalidInput):
        LocalRdma(None)
    with pytest.raises(InvalidInput):
        LocalRdma(SENDER, "and a reason")
    with pytest.raises(ConfigError):
        SetupConfig(timeout_s=0)
    with pytest.raises(ConfigError):
        SetupConfig(min_slot_bytes=0)


INPUTS = st.lists(
    st.one_of(
        st.sampled_from(
            [RdmaSetup(RECEIVER), RdmaSetup(SENDER), RdmaReady(), RdmaDecline(ErrorCode.UNAVAILABLE, "x")]
        ),
        st.sampled_from(["connected", "failed"]),
        st.floats(0.0, 10.0),  # a timer tick at that time
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ChannelRole), st.booleans(), st.booleans(), INPUTS)
def test_any_input_sequence_settles_by_the_deadline(
    role: ChannelRole, offers: bool, local_ok: bool, inputs: list[object]
) -> None:
    """Whatever arrives in whatever order, nothing raises, and after the deadline the path is decided,
    the timer is off, and every TCP decision carries a reason."""
    m = side(role, offers=offers, local=None if local_ok else LocalRdma.unavailable("no device"))
    for item in inputs:
        if isinstance(item, float):
            m.handle_timer(item)
        elif item == "connected":
            if m.state is SetupState.CONNECTING:
                m.endpoint_connected(0.0)
        elif item == "failed":
            m.local_failed("verbs failure", 0.0)
        else:
            assert isinstance(item, WireMessage)
            m.receive(item, 0.0)
        m.messages_to_send()
    if m.state is SetupState.CONNECTING:
        m.endpoint_connected(0.0)
    m.handle_timer(5.0)
    assert m.state in (SetupState.RDMA, SetupState.TCP) and m.get_timer() is None
    assert m.outcome is not None and m.outcome.path == m.state.value
    assert (m.outcome.fallback is None) == (m.state is SetupState.RDMA) and m.outcome.reason
    if m.state is SetupState.TCP:
        assert m.error is not None


def test_hello_capability_is_plain_text_in_the_hello() -> None:
    """Old peers see an unknown capability string, never an unknown message type."""
    hello = Hello("p-a", "p", 1, 1, ("session:abc", "rdma/1"))
    assert Decoder().feed(encode(hello)) == [hello]


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=1500))
def test_a_long_non_ascii_reason_is_cut_to_the_wire_limit_in_bytes(text: str) -> None:
    """REASON holds 1024 UTF-8 bytes: a reason of 1024 characters may be 4096 bytes."""
    reason = "ошибка verbs: " + text + "é" * 1024  # over the limit in bytes, not in characters
    rx = side(ChannelRole.RECEIVER)
    rx.messages_to_send()
    rx.local_failed(reason, 0.1)
    (decline,) = rx.messages_to_send()
    assert isinstance(decline, RdmaDecline) and decline.code is ErrorCode.UNAVAILABLE
    assert len(decline.reason.encode()) <= 1024 and len(decline.reason.encode()) > 1020
    assert reason.encode("utf-8", "replace").startswith(decline.reason.encode())
    assert Decoder().feed(encode(decline)) == [decline]
    assert rx.state is SetupState.TCP and rx.error is not None and rx.error.message == reason
