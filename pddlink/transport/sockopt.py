"""TCP socket tuning and TCP_INFO counters.

Congestion control is set per socket (``TCP_CONGESTION`` works inside network namespaces where the
sysctl does not). Socket buffers are deliberately left alone: setting SO_SNDBUF/SO_RCVBUF turns the
kernel's autotuning off, and autotuning up to ``net.ipv4.tcp_{w,r}mem`` maxima is what fills a long
line (raise the maxima with ``raise_buffer_maxima`` where root allows). ``tcp_info`` reads the
kernel's per-connection counters for retransmits and RTT.
"""

from __future__ import annotations

import logging
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# struct tcp_info (linux/tcp.h): 8 single bytes, then u32 fields; we read up to tcpi_total_retrans.
_TCP_INFO = struct.Struct("8B24I")
_RTT_INDEX, _TOTAL_RETRANS_INDEX = 8 + 15, 8 + 23
_warned: set[str] = set()
_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # asm-generic/socket.h


@dataclass(frozen=True, slots=True)
class TcpInfo:
    rtt_s: float
    total_retransmits: int


def available_congestion_controls() -> tuple[str, ...]:
    try:
        text = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text()
    except OSError:
        return ()
    return tuple(text.split())


def set_congestion_control(sock: socket.socket, name: str) -> str:
    """Set ``name`` on ``sock``; on failure keep the kernel default, log once, and return what runs."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, option, name.encode())
        except OSError as exc:
            if name not in _warned:
                _warned.add(name)
                log.warning("TCP congestion control %s unavailable (%s); using the default", name, exc)
        else:
            return name
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, 16)
        return raw.split(b"\0", 1)[0].decode()
    return "unknown"


def tune_tcp_socket(sock: socket.socket, congestion_control: str, idle_timeout_s: float = 60.0) -> str:
    """No Nagle (control frames must not wait), the chosen congestion control, and dead-peer
    detection: keepalive probes on an idle connection and ``TCP_USER_TIMEOUT`` for data left
    unacknowledged, both about ``idle_timeout_s`` (an outage shorter than that is ridden out)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(idle_timeout_s / 2))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 3)), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(idle_timeout_s * 1000))):  # fmt: skip
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    return set_congestion_control(sock, congestion_control)


def set_pacing_rate(sock: socket.socket, bytes_per_s: float) -> bool:
    """Cap the socket's pacing rate (``SO_MAX_PACING_RATE``; BBR and the kernel's internal pacing
    honour it). False, logged once, where the kernel refuses."""
    rate = min(int(bytes_per_s), 2**32 - 1)  # the kernel takes a u32 here (u64 on newer kernels)
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, rate)
    except OSError as exc:
        if "pacing" not in _warned:
            _warned.add("pacing")
            log.warning("cannot pace TCP stripes (SO_MAX_PACING_RATE: %s); they stay unpaced", exc)
        return False
    return True


def pacing_rate(sock: socket.socket) -> int:
    """The socket's pacing cap in bytes/s (``2**32 - 1``: none). The kernel answers a u32, which
    Python reads as a signed int."""
    return int(sock.getsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE)) & 0xFFFFFFFF


def tcp_info(sock: socket.socket) -> TcpInfo | None:
    """Retransmits and smoothed RTT of a connected socket, or None where TCP_INFO is missing."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or sock.fileno() < 0:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO.size:
        return None
    fields = _TCP_INFO.unpack(raw)
    return TcpInfo(rtt_s=fields[_RTT_INDEX] / 1e6, total_retransmits=fields[_TOTAL_RETRANS_INDEX])


def raise_buffer_maxima(max_bytes: int = 128 << 20) -> bool:
    """Raise the autotuning maxima of tcp_wmem/tcp_rmem (per network namespace; needs root)."""
    ok = True
    for name in ("tcp_wmem", "tcp_rmem"):
        path = Path("/proc/sys/net/ipv4") / name
        try:
            low, default, high = (int(v) for v in path.read_text().split())
            if high < max_bytes:
                path.write_text(f"{low} {default} {max_bytes}\n")
        except (OSError, ValueError) as exc:
            log.info("cannot raise %s maximum: %s", name, exc)
            ok = False
    return ok


def size_udp_buffers(sock: socket.socket, nbytes: int = 16 << 20) -> int:
    """Large UDP socket buffers for QUIC (UDP has no autotuning: the 208 KiB default drops bursts).

    Tries ``SO_RCVBUFFORCE`` (root, past ``rmem_max``), then plain ``SO_RCVBUF`` (capped by the
    kernel at ``net.core.rmem_max``); the same for sending. Returns the receive buffer granted.
    """
    for force, plain in (("SO_RCVBUFFORCE", socket.SO_RCVBUF), ("SO_SNDBUFFORCE", socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, getattr(socket, force, plain), nbytes)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)
    granted: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return granted
