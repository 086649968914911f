"""TUN devices with offloads, and the virtio-net header that comes with each packet.

A device opened with ``IFF_VNET_HDR`` and ``TUNSETOFFLOAD`` hands the relay segmentation
super-packets (TSO/USO) of up to 64 KiB with a 10-byte virtio-net header in front and a partial
checksum, and accepts them back the same way; the receiving stack takes them whole. That is what
lets a Python relay move several Gbit/s: one read and one write per ~44 packets.

The device lives as long as its file descriptor: when the relay exits (or is killed) the kernel
removes it, so a TUN device can never outlive the lab.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass

from pddlink.errors import Unavailable

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUNSETVNETHDRSZ = 0x400454D8
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO_ECN = 0x08
TUN_F_USO4 = 0x20
TUN_F_USO6 = 0x40  # the kernel accepts USO only for both families together

VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
VNET_HDR_LEN = VNET_HDR.size
F_NEEDS_CSUM = 1
GSO_NONE = 0
GSO_TCPV4 = 1
GSO_UDP_L4 = 5
GSO_ECN = 0x80
READ_BYTES = 65_536 + 256


@dataclass(frozen=True, slots=True)
class VnetHeader:
    flags: int
    gso_type: int
    hdr_len: int
    gso_size: int
    csum_start: int
    csum_offset: int

    @classmethod
    def parse(cls, data: bytes) -> VnetHeader:
        return cls(*VNET_HDR.unpack_from(data))

    def pack(self) -> bytes:
        return VNET_HDR.pack(
            self.flags, self.gso_type, self.hdr_len, self.gso_size, self.csum_start, self.csum_offset
        )


def open_tun(name: str, offload: bool = True) -> int:
    """Create TUN device ``name`` in the caller's network namespace; returns its non-blocking fd."""
    if len(name.encode()) > 15:
        raise ValueError(f"interface name {name!r} is longer than 15 bytes")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise Unavailable(
            f"cannot open /dev/net/tun ({exc.strerror}): the namespaced lab needs root"
        ) from exc
    try:
        flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))
        if offload:
            fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", VNET_HDR_LEN))
            fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO_ECN | TUN_F_USO4 | TUN_F_USO6)
    except OSError:
        os.close(fd)
        raise
    return fd


def burst_shape(pkt: bytes) -> tuple[int, int]:
    """(segments, wire bytes) of a packet read with a virtio-net header in front."""
    gso_type = pkt[1] & ~GSO_ECN
    if gso_type == GSO_NONE or len(pkt) < VNET_HDR_LEN + 40:  # plain, or too short to be a burst
        return 1, len(pkt) - VNET_HDR_LEN
    gso_size = pkt[4] | (pkt[5] << 8)
    ip_hl = (pkt[VNET_HDR_LEN] & 0x0F) * 4
    if len(pkt) < VNET_HDR_LEN + ip_hl + 20:
        return 1, len(pkt) - VNET_HDR_LEN
    if gso_type == GSO_TCPV4:
        l4_hl = (pkt[VNET_HDR_LEN + ip_hl + 12] >> 4) * 4
    elif gso_type == GSO_UDP_L4:
        l4_hl = 8
    else:  # a type we did not enable (IPv6): treat the burst as one unit
        return 1, len(pkt) - VNET_HDR_LEN
    headers = ip_hl + l4_hl
    payload = len(pkt) - VNET_HDR_LEN - headers
    segments = max(1, -(-payload // gso_size)) if gso_size else 1
    return segments, payload + segments * headers
