"""Splitting super-packets into wire packets and corrupting one: header fields and checksums."""

from __future__ import annotations

import random
import struct

import pytest

from netlab.segment import corrupt, cut, ones_complement_sum, split
from netlab.tun import F_NEEDS_CSUM, GSO_TCPV4, GSO_UDP_L4, VNET_HDR_LEN, VnetHeader, burst_shape

SRC, DST = bytes([198, 18, 0, 1]), bytes([198, 18, 0, 2])


def ipv4(proto: int, l4: bytes, ident: int = 100) -> bytes:
    hdr = bytearray(
        struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), ident, 0x4000, 64, proto, 0, SRC, DST)
    )
    hdr[10:12] = struct.pack("!H", 0xFFFF ^ ones_complement_sum(hdr))
    return bytes(hdr) + l4


def tcp_super(payload: bytes, mss: int, flags: int = 0x18 | 0x01 | 0x80) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", 40000, 5201, 1_000_000, 7, 5 << 4, flags, 65535, 0, 0) + payload
    vh = VnetHeader(F_NEEDS_CSUM, GSO_TCPV4, 40, mss, 20, 16).pack()
    return vh + ipv4(6, tcp)


def full_checksum_ok(pkt: bytes) -> bool:
    """Verify a wire packet as a receiver does: IP header and the transport checksum with pseudo-header."""
    body = pkt[VNET_HDR_LEN:]
    if ones_complement_sum(body[:20]) != 0xFFFF:
        return False
    pseudo = body[12:20] + struct.pack("!BBH", 0, body[9], len(body) - 20)
    return ones_complement_sum(pseudo + body[20:]) == 0xFFFF


def complete(pkt: bytes) -> bytes:
    """Fill in a partial transport checksum the way a NIC would."""
    vh = VnetHeader.parse(pkt)
    body = bytearray(pkt[VNET_HDR_LEN:])
    at = vh.csum_start + vh.csum_offset
    total = ones_complement_sum(body[vh.csum_start :])
    body[at : at + 2] = struct.pack("!H", 0xFFFF ^ total)
    return VnetHeader(0, 0, 0, 0, 0, 0).pack() + bytes(body)


def test_tcp_super_packet_splits_like_software_segmentation() -> None:
    payload = bytes(range(256)) * 20  # 5120 bytes -> 4 segments of 1448 and one short one
    pkt = tcp_super(payload, 1448)
    assert burst_shape(pkt) == (4, 5120 + 4 * 40)
    parts = split(pkt)
    assert len(parts) == 4
    joined = b""
    for i, part in enumerate(parts):
        body = part[VNET_HDR_LEN:]
        total_len, ident = struct.unpack_from("!HH", body, 2)
        seq = struct.unpack_from("!I", body, 24)[0]
        flags = body[33]
        assert total_len == len(body) and ident == 100 + i
        assert seq == 1_000_000 + 1448 * i
        assert bool(flags & 0x01) == (i == 3) and bool(flags & 0x08) == (i == 3)  # FIN, PSH on the last
        assert bool(flags & 0x80) == (i == 0)  # CWR on the first
        assert VnetHeader.parse(part).gso_type == 0
        assert full_checksum_ok(complete(part))
        joined += body[40:]
    assert joined == payload


def test_udp_uso_super_packet_splits_into_datagrams() -> None:
    payload = b"q" * 3000
    udp = struct.pack("!HHHH", 5000, 4433, 8 + len(payload), 0) + payload
    pkt = VnetHeader(F_NEEDS_CSUM, GSO_UDP_L4, 28, 1200, 20, 6).pack() + ipv4(17, udp)
    assert burst_shape(pkt)[0] == 3
    parts = split(pkt)
    assert [len(p) - VNET_HDR_LEN for p in parts] == [1228, 1228, 628]
    for part in parts:
        body = part[VNET_HDR_LEN:]
        assert struct.unpack_from("!H", body, 24)[0] == len(body) - 20  # UDP length
        assert full_checksum_ok(complete(part))


@pytest.mark.parametrize(("first", "count"), [(0, 1), (0, 3), (1, 2), (2, 2), (3, 1), (0, 4)])
def test_a_run_cut_from_a_burst_segments_like_the_burst(first: int, count: int) -> None:
    pkt = tcp_super(bytes(range(256)) * 20, 1448)
    run = cut(pkt, first, count)
    vh = VnetHeader.parse(run)
    assert (vh.gso_type != 0) == (count > 1)
    assert split(run) == split(pkt)[first : first + count]
    body = run[VNET_HDR_LEN:]
    assert struct.unpack_from("!H", body, 2)[0] == len(body)
    assert full_checksum_ok(complete(run))  # the partial checksum carries the run's length


def test_plain_packet_is_not_split() -> None:
    pkt = VnetHeader(0, 0, 0, 0, 0, 0).pack() + ipv4(17, b"\0" * 8 + b"hello")
    assert split(pkt) == [pkt] and burst_shape(pkt) == (1, len(pkt) - VNET_HDR_LEN)


@pytest.mark.parametrize("seed", range(20))
def test_corruption_flips_one_bit_of_a_checksummed_packet(seed: int) -> None:
    part = split(tcp_super(b"z" * 3000, 1448))[1]
    bad = corrupt(part, random.Random(seed))
    good = complete(part)
    assert VnetHeader.parse(bad).flags == 0  # the receiver must verify it
    diff = [a ^ b for a, b in zip(good, bad, strict=True) if a != b]
    assert len(diff) == 1 and bin(diff[0]).count("1") == 1
    assert full_checksum_ok(good) and not full_checksum_ok(bad)
