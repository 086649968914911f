"""Splitting a segmentation super-packet into wire packets, and corrupting one of them.

The relay calls this only when the link model gives the segments of one burst different fates (a
loss, a queue overflow, a reordered, duplicated or corrupted segment), so it may be plain Python.
Each segment gets its own IPv4 header (length, id, header checksum) and TCP sequence number / UDP
length, exactly as the kernel's software segmentation would produce them; the transport checksum
stays partial (the virtio-net header says where it starts), as in the super-packet.

A corrupted segment has its checksum completed first and is then written without the partial-checksum
flag, so the receiving stack verifies it and drops it, as a receiver drops a packet damaged on a line.
"""

from __future__ import annotations

import random
import struct

from netlab.tun import (
    F_NEEDS_CSUM,
    GSO_ECN,
    GSO_NONE,
    GSO_TCPV4,
    GSO_UDP_L4,
    VNET_HDR_LEN,
    VnetHeader,
)

_TCP_FIN_PSH = 0x01 | 0x08
_TCP_CWR = 0x80


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def ones_complement_sum(data: bytes | bytearray | memoryview) -> int:
    """The 16-bit one's complement sum of ``data`` (big-endian words, odd length padded)."""
    if len(data) % 2:
        data = bytes(data) + b"\0"
    return _fold(int(sum(struct.unpack(f"!{len(data) // 2}H", data))))


def _pseudo_header_sum(ip: bytes | bytearray, proto: int, l4_len: int) -> int:
    return ones_complement_sum(bytes(ip[12:20]) + struct.pack("!BBH", 0, proto, l4_len))


def _ipv4_checksum(hdr: bytearray, ip_hl: int) -> None:
    hdr[10:12] = b"\0\0"
    hdr[10:12] = struct.pack("!H", 0xFFFF ^ ones_complement_sum(hdr[:ip_hl]))


def cut(pkt: bytes, first: int, count: int) -> bytes:
    """Segments ``[first, first+count)`` of a burst as one packet: a smaller super-packet, or a wire packet.

    Runs are what the link model decides on (the segments before a loss, those after it), so a loss
    in a 44-segment burst costs two writes, not 43."""
    vh = VnetHeader.parse(pkt)
    gso = vh.gso_type & ~GSO_ECN
    if gso not in (GSO_TCPV4, GSO_UDP_L4) or vh.gso_size == 0:
        return pkt
    ip = pkt[VNET_HDR_LEN:]
    ip_hl = (ip[0] & 0x0F) * 4
    l4_hl = (ip[ip_hl + 12] >> 4) * 4 if gso == GSO_TCPV4 else 8
    headers = ip_hl + l4_hl
    payload_len = len(ip) - headers
    segments = -(-payload_len // vh.gso_size)
    start = first * vh.gso_size
    chunk = ip[headers + start : headers + min(payload_len, (first + count) * vh.gso_size)]
    hdr = bytearray(ip[:headers])
    ip_id = struct.unpack_from("!H", hdr, 4)[0]
    struct.pack_into("!HH", hdr, 2, headers + len(chunk), (ip_id + first) & 0xFFFF)
    _ipv4_checksum(hdr, ip_hl)
    l4_len = l4_hl + len(chunk)
    if gso == GSO_TCPV4:
        seq = struct.unpack_from("!I", hdr, ip_hl + 4)[0]
        struct.pack_into("!I", hdr, ip_hl + 4, (seq + start) & 0xFFFFFFFF)
        if first + count < segments:
            hdr[ip_hl + 13] &= ~_TCP_FIN_PSH & 0xFF
        if first > 0:
            hdr[ip_hl + 13] &= ~_TCP_CWR & 0xFF
        csum_offset = 16
    else:
        struct.pack_into("!H", hdr, ip_hl + 4, min(l4_len, 0xFFFF))
        csum_offset = 6
    struct.pack_into("!H", hdr, ip_hl + csum_offset, _pseudo_header_sum(hdr, ip[9], l4_len))
    if count > 1:
        out_vh = VnetHeader(F_NEEDS_CSUM, vh.gso_type, headers, vh.gso_size, ip_hl, csum_offset)
    else:
        out_vh = VnetHeader(F_NEEDS_CSUM, GSO_NONE, 0, 0, ip_hl, csum_offset)
    return out_vh.pack() + bytes(hdr) + chunk


def split(pkt: bytes) -> list[bytes]:
    """The wire packets of a burst, each with its own virtio-net header; a plain packet is returned as is."""
    vh = VnetHeader.parse(pkt)
    gso = vh.gso_type & ~GSO_ECN
    if gso not in (GSO_TCPV4, GSO_UDP_L4) or vh.gso_size == 0:
        return [pkt]
    ip_hl = (pkt[VNET_HDR_LEN] & 0x0F) * 4
    l4_hl = (pkt[VNET_HDR_LEN + ip_hl + 12] >> 4) * 4 if gso == GSO_TCPV4 else 8
    payload_len = len(pkt) - VNET_HDR_LEN - ip_hl - l4_hl
    return [cut(pkt, i, 1) for i in range(-(-payload_len // vh.gso_size))]


def corrupt(pkt: bytes, rng: random.Random) -> bytes:
    """``pkt`` (a wire packet with its virtio-net header), checksum completed, then one bit flipped."""
    vh = VnetHeader.parse(pkt)
    body = bytearray(pkt[VNET_HDR_LEN:])
    if vh.flags & F_NEEDS_CSUM:
        start, at = vh.csum_start, vh.csum_start + vh.csum_offset
        body[at : at + 2] = b"\0\0"
        proto = body[9]
        pseudo = _pseudo_header_sum(body, proto, len(body) - start)
        total = _fold(pseudo + ones_complement_sum(body[start:]))
        body[at : at + 2] = struct.pack("!H", (0xFFFF ^ total) or 0xFFFF)
    ip_hl = (body[0] & 0x0F) * 4
    first = min(ip_hl + 8, len(body) - 1)  # past the ports: damage the data, not the addressing
    bit = rng.randrange(first * 8, len(body) * 8)
    body[bit // 8] ^= 1 << (bit % 8)
    return VnetHeader(0, GSO_NONE, 0, 0, 0, 0).pack() + bytes(body)
