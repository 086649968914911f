"""RDMA verbs layer: endpoint fields, availability reasons, and a real loopback channel where a
device exists (skipped here with the reason: this machine has no RDMA device and no pyverbs).
The set-up exchange is tested in tests/wire/test_wire_rdma_setup.py, the link in test_rdma_fallback.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pddlink.errors import ConfigError, InvalidInput, Unavailable
from pddlink.transport.rdma import (
    QP_ACCESS_FLAGS,
    ChannelRole,
    RdmaChannel,
    RdmaConfig,
    RdmaEndpoint,
    RdmaError,
    gid_bytes,
    qp_attr_towards,
    qp_init_attr,
    rdma_available,
    require_rdma,
    write_request,
)
from pddlink.wire import PathMtu

AVAILABLE, REASON = rdma_available()
needs_device = pytest.mark.skipif(not AVAILABLE, reason=f"RDMA fast path unavailable: {REASON}")


def test_endpoint_refuses_out_of_range_fields() -> None:
    good = dict(
        role=ChannelRole.SENDER, qp_num=7, psn=1, lid=0, port_num=1, path_mtu=PathMtu.MTU_1024, gid=bytes(16)
    )
    for field, value in (("qp_num", 1 << 24), ("psn", -1), ("path_mtu", 6), ("gid", b"\x00" * 4)):
        with pytest.raises(InvalidInput, match=field):
            RdmaEndpoint(**{**good, field: value})  # type: ignore[arg-type]
    receiver = RdmaEndpoint(**{**good, "role": ChannelRole.RECEIVER, "slots": 4, "slot_bytes": 1 << 20})  # type: ignore[arg-type]
    assert receiver.length == 4 << 20
    assert RdmaEndpoint(**good).gid_text == ":".join(["0000"] * 8)  # type: ignore[arg-type]


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


def test_the_init_access_flags_are_local_and_remote_write() -> None:
    """Without pyverbs: the libibverbs ABI values (the pyverbs test below checks them against it;
    test_rdma_verbs_faults.py checks the channel creates its queue pair with them)."""
    assert QP_ACCESS_FLAGS == 0b11  # IBV_ACCESS_LOCAL_WRITE (1) | IBV_ACCESS_REMOTE_WRITE (2)


def test_the_verbs_requests_we_build_are_accepted_by_pyverbs() -> None:
    """Needs pyverbs but no device: the QP attributes and the write request RdmaChannel posts."""
    pytest.importorskip("pyverbs", reason="pyverbs is not installed (see rdma.INSTALL_HINT)")
    gid = gid_bytes("fe80::202:c9ff:fe01:2345")
    peer = RdmaEndpoint(ChannelRole.RECEIVER, 0x1234, 77, 3, 1, PathMtu.MTU_4096, gid, 9, 1 << 30, 4, 1 << 20)
    config = RdmaConfig(slots=4, slot_bytes=1 << 20, path_mtu=3)
    attr = qp_attr_towards(peer, config, psn=5)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (0x1234, 77, 5, 3)
    assert (attr.retry_cnt, attr.rnr_retry, attr.timeout) == (7, 7, 14)
    assert attr.ah_attr.hop_limit == 64  # routed RoCE v2 (pyverbs' default is 1)
    import pyverbs.enums as e

    init = qp_init_attr(config)  # RESET -> INIT: without REMOTE_WRITE the receiver refuses writes
    assert QP_ACCESS_FLAGS == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    assert (init.qp_access_flags, init.port_num, init.pkey_index) == (QP_ACCESS_FLAGS, 1, 0)
    assert (
        write_request(2, (0x1000, 100, 11), (peer.addr + 2 * peer.slot_bytes, peer.rkey), imm=2) is not None
    )


@pytest.mark.skipif(AVAILABLE, reason="this machine has an RDMA device")
def test_without_a_device_the_channel_refuses_with_the_reason() -> None:
    """(The transport falls back to TCP instead: test_rdma_fallback.py.)"""
    with pytest.raises(Unavailable, match="RDMA fast path unavailable"):
        RdmaChannel(ChannelRole.SENDER)
    with pytest.raises(Unavailable, match="RDMA fast path unavailable"):
        RdmaChannel(ChannelRole.RECEIVER)


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
            slot = index % config.slots
            sender.write_frame(slot, (chunk[:10], memoryview(chunk)[10:]), imm=slot)
            assert not sender.poll(5.0)[0].received  # our write completed: the slot is free again
            done = receiver.poll(5.0)[0]
            assert done.received and done.imm == slot and done.byte_len == len(chunk)
            landed[index] = receiver.read_slot(slot, done.byte_len)
        assert [landed[i] for i in range(len(chunks))] == chunks
        with pytest.raises(InvalidInput):
            sender.write_frame(config.slots, (b"x",), imm=0)
    finally:
        sender.close()
        receiver.close()
