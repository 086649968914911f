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


def split(pkt: bytes) -> list[bytes]:
    """The wire packets of a burst, each with its own virtio-net header; a plain packet is returned as is."""
    vh = VnetHeader.parse(pkt)
    gso = vh.gso_type & ~GSO_ECN
    if gso not in (GSO_TCPV4, GSO_UDP_L4) or vh.gso_size == 0:
        return [pkt]
    ip = pkt[VNET_HDR_LEN:]
    ip_hl = (ip[0] & 0x0F) * 4
    proto = ip[9]
    l4_hl = (ip[ip_hl + 12] >> 4) * 4 if gso == GSO_TCPV4 else 8
    headers = ip_hl + l4_hl
    payload = ip[headers:]
    ip_id = struct.unpack_from("!H", ip, 4)[0]
    seq = struct.unpack_from("!I", ip, ip_hl + 4)[0] if gso == GSO_TCPV4 else 0
    csum_offset = 16 if gso == GSO_TCPV4 else 6
    out_vh = VnetHeader(F_NEEDS_CSUM, GSO_NONE, 0, 0, ip_hl, csum_offset).pack()
    chunks = range(0, len(payload), vh.gso_size)
    out = []
    for i, off in enumerate(chunks):
        chunk = payload[off : off + vh.gso_size]
        hdr = bytearray(ip[:headers])
        struct.pack_into("!HH", hdr, 2, headers + len(chunk), (ip_id + i) & 0xFFFF)
        _ipv4_checksum(hdr, ip_hl)
        l4_len = l4_hl + len(chunk)
        if gso == GSO_TCPV4:
            struct.pack_into("!I", hdr, ip_hl + 4, (seq + off) & 0xFFFFFFFF)
            if i < len(chunks) - 1:
                hdr[ip_hl + 13] &= ~_TCP_FIN_PSH & 0xFF
            if i > 0:
                hdr[ip_hl + 13] &= ~_TCP_CWR & 0xFF
        else:
            struct.pack_into("!H", hdr, ip_hl + 4, l4_len)
        struct.pack_into("!H", hdr, ip_hl + csum_offset, _pseudo_header_sum(hdr, proto, l4_len))
        out.append(out_vh + bytes(hdr) + chunk)
    return out


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
