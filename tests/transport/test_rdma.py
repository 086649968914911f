"""RDMA fast path: set-up parameters, availability reasons, and a real loopback channel where a
device exists (skipped here with the reason: this machine has no RDMA device and no pyverbs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.errors import ConfigError, InvalidInput, Unavailable
from pddlink.transport.rdma import (
    ChannelRole,
    RdmaChannel,
    RdmaConfig,
    RdmaEndpoint,
    RdmaError,
    RdmaTransport,
    gid_bytes,
    rdma_available,
    require_rdma,
)

AVAILABLE, REASON = rdma_available()
needs_device = pytest.mark.skipif(not AVAILABLE, reason=f"RDMA fast path unavailable: {REASON}")

ENDPOINTS = st.builds(
    RdmaEndpoint,
    role=st.just(ChannelRole.RECEIVER),
    qp_num=st.integers(0, (1 << 24) - 1),
    psn=st.integers(0, (1 << 24) - 1),
    lid=st.integers(0, 0xFFFF),
    port_num=st.integers(1, 255),
    path_mtu=st.integers(1, 5),
    gid=st.binary(min_size=16, max_size=16),
    rkey=st.integers(0, (1 << 32) - 1),
    addr=st.integers(0, (1 << 64) - 1),
    length=st.integers(1 << 20, 1 << 40),
    slot_bytes=st.integers(1, 1 << 20),
)


@given(ENDPOINTS)
def test_endpoint_round_trips_through_its_wire_body(endpoint: RdmaEndpoint) -> None:
    body = endpoint.to_bytes()
    assert len(body) == 56
    assert RdmaEndpoint.from_bytes(body) == endpoint
    assert gid_bytes(endpoint.gid_text) == endpoint.gid


def test_endpoint_refuses_out_of_range_fields_and_bad_bodies() -> None:
    good = dict(role=ChannelRole.SENDER, qp_num=7, psn=1, lid=0, port_num=1, path_mtu=3, gid=bytes(16))
    for field, value in (("qp_num", 1 << 24), ("psn", -1), ("path_mtu", 6), ("gid", b"\x00" * 4)):
        with pytest.raises(InvalidInput, match=field):
            RdmaEndpoint(**{**good, field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="landing region"):
        RdmaEndpoint(**{**good, "role": ChannelRole.RECEIVER})  # type: ignore[arg-type]
    body = RdmaEndpoint(**good).to_bytes()  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="version"):
        RdmaEndpoint.from_bytes(b"\x09" + body[1:])
    with pytest.raises(InvalidInput, match="role"):
        RdmaEndpoint.from_bytes(body[:1] + b"\x07" + body[2:])
    with pytest.raises(InvalidInput, match="56 bytes"):
        RdmaEndpoint.from_bytes(body[:-1])


def test_gid_parses_libibverbs_and_ipv6_text() -> None:
    roce = "0000:0000:0000:0000:0000:ffff:c612:0001"  # RoCE v2 GID of 198.18.0.1
    assert gid_bytes(roce) == bytes(10) + b"\xff\xff\xc6\x12\x00\x01"
    assert gid_bytes("fe80::1") == b"\xfe\x80" + bytes(13) + b"\x01"
    with pytest.raises(InvalidInput):
        gid_bytes("fe80:zz")


def test_config_is_validated() -> None:
    for kwargs in ({"slots": 0}, {"slot_bytes": 100}, {"path_mtu": 9}, {"port_num": 0}):
        with pytest.raises(ConfigError):
            RdmaConfig(**kwargs)  # type: ignore[arg-type]
    assert RdmaConfig(slots=4, slot_bytes=1 << 20).region_bytes == 4 << 20


def test_availability_reasons(tmp_path: Path) -> None:
    def no_pyverbs() -> list[str]:
        raise ImportError("No module named 'pyverbs'")

    ok, reason = rdma_available(no_pyverbs, sysfs=tmp_path / "absent")
    assert not ok and "pip install 'pddlink[rdma]'" in reason and "no devices" in reason
    (tmp_path / "rxe0").mkdir()
    ok, reason = rdma_available(no_pyverbs, sysfs=tmp_path)
    assert not ok and "kernel devices rxe0" in reason

    def verbs_without_stack() -> list[str]:
        raise RdmaError("libibverbs cannot list devices (Failed to get devices list)")

    ok, reason = rdma_available(verbs_without_stack)
    assert not ok and "cannot list devices" in reason and "rdma_rxe" in reason
    assert rdma_available(lambda: [])[0] is False
    assert "rdma_rxe" in rdma_available(lambda: [])[1]
    assert rdma_available(lambda: ["mlx5_0"]) == (True, "RDMA device(s): mlx5_0")
    with pytest.raises(Unavailable, match="no RDMA device"):
        require_rdma(lambda: [])


@pytest.mark.skipif(AVAILABLE, reason="this machine has an RDMA device")
def test_without_a_device_the_transport_and_channel_refuse_with_the_reason() -> None:
    with pytest.raises(Unavailable, match="RDMA fast path unavailable"):
        RdmaChannel(ChannelRole.SENDER)
    with pytest.raises(Unavailable, match="RDMA fast path unavailable"):
        asyncio.run(RdmaTransport.connect("127.0.0.1", 1))
    with pytest.raises(Unavailable, match="RDMA fast path unavailable"):
        asyncio.run(RdmaTransport.listen("127.0.0.1", 0))


@needs_device
def test_loopback_channel_writes_chunks_with_immediate() -> None:
    """Two RC queue pairs on the same device: every chunk lands in its slot, announced by index."""
    config = RdmaConfig(slots=4, slot_bytes=64 << 10)
    sender, receiver = RdmaChannel(ChannelRole.SENDER, config), RdmaChannel(ChannelRole.RECEIVER, config)
    try:
        receiver.post_receives(config.slots)
        sender.connect(receiver.endpoint())
        receiver.connect(sender.endpoint())
        chunks = [bytes([i]) * (1000 + 997 * i) for i in range(10)]
        landed: dict[int, bytes] = {}
        for index, chunk in enumerate(chunks):
            sender.write_chunk(index % config.slots, chunk, imm=index)
            assert not sender.poll(5.0)[0].received  # our write completed: the slot is free again
            done = receiver.poll(5.0)[0]
            assert done.received and done.imm == index and done.byte_len == len(chunk)
            landed[done.imm] = receiver.read_slot(index % config.slots, done.byte_len)
        assert [landed[i] for i in range(len(chunks))] == chunks
        with pytest.raises(InvalidInput):
            sender.write_chunk(config.slots, b"x", imm=0)
    finally:
        sender.close()
        receiver.close()
