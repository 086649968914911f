"""RDMA fast path (pyverbs): reliable-connected QPs, registered regions, chunk writes with immediate.

Where it sits. Inside a datacenter P ships prompt KV to RelayDecode over RDMA; control messages
(hello, transfer begin/end, acks, handoff) stay on the TCP control link of ``pddlink.transport.tcp``
and the sans-I/O transfer machine (``pddlink.transfer``) still owns windows, acks and digests. Only
chunk bytes move by RDMA. Where no device or no pyverbs exists, ``rdma_available()`` says why,
``RdmaTransport`` raises ``Unavailable`` with that reason, and the registry's ``auto`` uses TCP.

Lifecycle of one channel (one RC queue pair per peer and direction)::

    receiver                                   sender
    RdmaChannel(device, role=RECEIVER)         RdmaChannel(device, role=SENDER)
      landing region: slots x slot_bytes,        staging region: slots x slot_bytes,
      REMOTE_WRITE                               LOCAL_WRITE
    endpoint() ---- control link: RdmaEndpoint (qpn, psn, lid, gid, rkey, addr, length) ---->
    <--------------------------------------------------------------------------- endpoint()
    connect(peer)   INIT -> RTR -> RTS         connect(peer)
    post_receives(slots)
                                               write_chunk(slot, data, imm=chunk index)
                                               = RDMA WRITE WITH IMMEDIATE into peer slot
    poll() -> RdmaCompletion(imm, byte_len)    poll() -> send completion: the slot is free again
    read_slot(slot, n) -> the chunk; the transfer machine acks it on the control link; the ack
    frees the slot for the sender's next chunk (the window is ``slots`` chunks).
    close()                                    close()

The write-with-immediate consumes one posted receive on the receiver and raises one completion
there carrying the chunk index, so no separate "chunk landed" message is needed. ``imm`` travels as
the raw 32-bit value (both ends of a datacenter link are little-endian hosts; the transfer
machine's per-chunk checksum still guards the bytes).

Install (see the project report): ``apt-get install libnl-3-dev libnl-route-3-dev cmake`` then
``pip install 'pddlink[rdma]'`` (pyverbs >= 59 builds with Cython 3), or the distribution package
``python3-pyverbs`` for the system Python.
"""

from __future__ import annotations

import ipaddress
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Final

from pddlink.errors import ConfigError, DeadlineExceeded, ErrorCode, InvalidInput, LocalError, Unavailable

INFINIBAND_SYSFS: Final = Path("/sys/class/infiniband")
INSTALL_HINT: Final = (
    "install pyverbs: apt-get install libnl-3-dev libnl-route-3-dev cmake && pip install 'pddlink[rdma]'"
    " (or apt-get install python3-pyverbs for the system Python)"
)
NO_DEVICE_HINT: Final = (
    "no RDMA device: needs an RDMA NIC, or Soft-RoCE on a kernel with rdma_rxe"
    " (modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0)"
)


class RdmaError(LocalError):
    """A verbs call or a work completion failed (the message names the call and the status)."""

    code = ErrorCode.PEER_UNREACHABLE


def list_devices_pyverbs() -> list[str]:
    """RDMA device names as libibverbs sees them. ImportError without pyverbs; ``RdmaError`` when
    libibverbs cannot list devices (it fails that way on a host with no RDMA stack at all)."""
    import pyverbs.device
    from pyverbs.pyverbs_error import PyverbsError

    try:
        devices = pyverbs.device.get_device_list()
    except PyverbsError as exc:
        raise RdmaError(f"libibverbs cannot list devices ({exc})") from exc
    return sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)


def rdma_available(
    list_devices: Callable[[], list[str]] = list_devices_pyverbs, sysfs: Path = INFINIBAND_SYSFS
) -> tuple[bool, str]:
    """(usable, reason): pyverbs importable and at least one device present."""
    try:
        devices = list_devices()
    except ImportError as exc:
        kernel = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []
        seen = f"kernel devices {', '.join(kernel)}" if kernel else f"no devices under {sysfs} either"
        return False, f"pyverbs is not importable ({exc}); {seen}; {INSTALL_HINT}"
    except RdmaError as exc:
        return False, f"{exc.message}; {NO_DEVICE_HINT}"
    if not devices:
        return False, NO_DEVICE_HINT
    return True, f"RDMA device(s): {', '.join(devices)}"


def require_rdma(list_devices: Callable[[], list[str]] = list_devices_pyverbs) -> None:
    ok, reason = rdma_available(list_devices)
    if not ok:
        raise Unavailable(f"RDMA fast path unavailable: {reason}")


# --------------------------------------------------------------------------- set-up parameters

_ENDPOINT = struct.Struct("<BBHIIHB B16sIQQI")  # version, role, reserved, qpn, psn, lid, port, mtu, gid,
#                                               rkey, addr, length, slot_bytes
ENDPOINT_VERSION: Final = 1


class ChannelRole(Enum):
    SENDER = 1
    RECEIVER = 2


@dataclass(frozen=True, slots=True)
class RdmaEndpoint:
    """What one side tells the other over the control link to connect an RC queue pair.

    ``gid`` is the 16-byte GID (RoCE needs it; on InfiniBand ``lid`` routes); ``rkey``/``addr``/
    ``length`` describe the receiver's landing region (zero on the sender); ``slot_bytes`` the
    size of one chunk slot in it. ``to_bytes``/``from_bytes`` give the body of the proposed wire
    message ``RdmaSetup`` (56 bytes)."""

    role: ChannelRole
    qp_num: int
    psn: int
    lid: int
    port_num: int
    path_mtu: int  # IBV_MTU_* enum value (1..5 = 256..4096 bytes)
    gid: bytes
    rkey: int = 0
    addr: int = 0
    length: int = 0
    slot_bytes: int = 0

    def __post_init__(self) -> None:
        limits = {"qp_num": 24, "psn": 24, "lid": 16, "port_num": 8, "rkey": 32, "addr": 64, "length": 64}
        for name, bits in limits.items():
            value = getattr(self, name)
            if not 0 <= value < 1 << bits:
                raise InvalidInput(f"RdmaEndpoint.{name}={value} does not fit {bits} bits")
        if not 1 <= self.path_mtu <= 5:
            raise InvalidInput(f"RdmaEndpoint.path_mtu={self.path_mtu} is not an IBV_MTU value (1-5)")
        if len(self.gid) != 16:
            raise InvalidInput(f"RdmaEndpoint.gid must be 16 bytes, got {len(self.gid)}")
        if not 0 <= self.slot_bytes < 1 << 32 or self.slot_bytes > self.length:
            raise InvalidInput("RdmaEndpoint.slot_bytes must fit in the region")
        if self.role is ChannelRole.RECEIVER and (self.length == 0 or self.slot_bytes == 0):
            raise InvalidInput("a receiver endpoint must describe its landing region")

    @property
    def slots(self) -> int:
        return self.length // self.slot_bytes if self.slot_bytes else 0

    def to_bytes(self) -> bytes:
        return _ENDPOINT.pack(
            ENDPOINT_VERSION, self.role.value, 0, self.qp_num, self.psn, self.lid, self.port_num,
            self.path_mtu, self.gid, self.rkey, self.addr, self.length, self.slot_bytes,
        )  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> RdmaEndpoint:
        if len(data) != _ENDPOINT.size:
            raise InvalidInput(f"RdmaEndpoint is {_ENDPOINT.size} bytes, got {len(data)}")
        version, role, _, qpn, psn, lid, port, mtu, gid, rkey, addr, length, slot = _ENDPOINT.unpack(data)
        if version != ENDPOINT_VERSION:
            raise InvalidInput(f"RdmaEndpoint version {version}, this build speaks {ENDPOINT_VERSION}")
        try:
            kind = ChannelRole(role)
        except ValueError:
            raise InvalidInput(f"RdmaEndpoint role {role} is unknown") from None
        return cls(kind, qpn, psn, lid, port, mtu, gid, rkey, addr, length, slot)

    @property
    def gid_text(self) -> str:
        """The GID as libibverbs prints it (eight groups of four hex digits)."""
        h = self.gid.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    """Bytes of a GID given as libibverbs prints it ("fe80:0000:...") or as an IPv6 address."""
    try:
        return ipaddress.IPv6Address(text).packed
    except ValueError:
        pass
    digits = text.replace(":", "")
    if len(digits) != 32:
        raise InvalidInput(f"not a GID: {text!r}")
    try:
        return bytes.fromhex(digits)
    except ValueError:
        raise InvalidInput(f"not a GID: {text!r}") from None


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """One channel's resources. ``device=None`` takes the first device; the landing region is
    ``slots * slot_bytes`` (the transfer window in chunks)."""

    device: str | None = None
    port_num: int = 1
    gid_index: int = 0
    slots: int = 16
    slot_bytes: int = 4 << 20
    path_mtu: int = 3  # IBV_MTU_1024, safe on RoCE with a 1500-byte Ethernet MTU
    timeout: int = 14  # local ACK timeout exponent: 4.096 us * 2**14 = 67 ms
    retry_count: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 12

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= 4096:
            raise ConfigError(f"rdma.slots={self.slots}: must be 1-4096")
        if not 4096 <= self.slot_bytes <= 1 << 30:
            raise ConfigError(f"rdma.slot_bytes={self.slot_bytes}: must be 4 KiB - 1 GiB")
        if not 1 <= self.path_mtu <= 5:
            raise ConfigError(f"rdma.path_mtu={self.path_mtu}: must be an IBV_MTU value 1-5")
        if not 1 <= self.port_num <= 255 or self.gid_index < 0:
            raise ConfigError("rdma.port_num must be 1-255 and gid_index >= 0")

    @property
    def region_bytes(self) -> int:
        return self.slots * self.slot_bytes


@dataclass(frozen=True, slots=True)
class RdmaCompletion:
    """One work completion: a landed chunk (receiver: ``imm`` = chunk index) or a finished write."""

    wr_id: int
    imm: int
    byte_len: int
    received: bool  # True on the receiver (RECV_RDMA_WITH_IMM), False for the sender's own write


class RdmaChannel:
    """One RC queue pair with its registered region, protection domain and completion queue.

    Not thread-safe; one owner (the transport's data task) drives it. Every wait is bounded by a
    ``timeout_s`` and raises ``DeadlineExceeded``; a failed completion raises ``RdmaError``."""

    def __init__(self, role: ChannelRole, config: RdmaConfig | None = None) -> None:
        require_rdma()
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.role = role
        self.config = cfg = config or RdmaConfig()
        self._e = e
        name = cfg.device or list_devices_pyverbs()[0]
        self._ctx = Context(name=name)
        self._pd = PD(self._ctx)
        depth = cfg.slots + 1
        self._cq = CQ(self._ctx, 2 * depth, None, None, 0)
        access = e.IBV_ACCESS_LOCAL_WRITE
        if role is ChannelRole.RECEIVER:
            access |= e.IBV_ACCESS_REMOTE_WRITE
        self._mr = MR(self._pd, cfg.region_bytes, access)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=1)
        self._qp = QP(self._pd, init, QPAttr(port_num=cfg.port_num))  # created in INIT
        self._psn = secrets.randbelow(1 << 24)
        self._peer: RdmaEndpoint | None = None
        self._in_flight = 0
        self.device = name

    def endpoint(self) -> RdmaEndpoint:
        """This side's set-up parameters, to send over the control link."""
        cfg = self.config
        port = self._ctx.query_port(cfg.port_num)
        gid = gid_bytes(str(self._ctx.query_gid(cfg.port_num, cfg.gid_index).gid))
        receiver = self.role is ChannelRole.RECEIVER
        return RdmaEndpoint(
            self.role, int(self._qp.qp_num), self._psn, int(port.lid), cfg.port_num,
            min(cfg.path_mtu, int(port.active_mtu)), gid,
            rkey=int(self._mr.rkey) if receiver else 0, addr=int(self._mr.buf) if receiver else 0,
            length=cfg.region_bytes if receiver else 0, slot_bytes=cfg.slot_bytes if receiver else 0,
        )  # fmt: skip

    def connect(self, peer: RdmaEndpoint) -> None:
        """Move the queue pair INIT -> RTR -> RTS towards ``peer``."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        if peer.role is self.role:
            raise InvalidInput(f"both ends of an RDMA channel claim the {self.role.name} role")
        if self.role is ChannelRole.SENDER and peer.slot_bytes < self.config.slot_bytes:
            raise InvalidInput(f"peer slots of {peer.slot_bytes} bytes are smaller than ours")
        cfg = self.config
        attr = QPAttr(port_num=cfg.port_num)
        attr.dest_qp_num = peer.qp_num
        attr.path_mtu = min(cfg.path_mtu, peer.path_mtu)
        attr.rq_psn, attr.sq_psn = peer.psn, self._psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout = cfg.min_rnr_timer, cfg.timeout
        attr.retry_cnt, attr.rnr_retry = cfg.retry_count, cfg.rnr_retry
        route = GlobalRoute(dgid=GID(peer.gid_text), sgid_index=cfg.gid_index)
        attr.ah_attr = AHAttr(port_num=cfg.port_num, is_global=1, gr=route, dlid=peer.lid)
        self._call("modify QP to RTS", self._qp.to_rts, attr)
        self._peer = peer

    def post_receives(self, count: int) -> None:
        """Receiver: one posted receive per chunk the sender may write (each write-with-imm uses one)."""
        from pyverbs.wr import SGE, RecvWR

        # pyverbs wants one SGE per WR; a write-with-imm lands at the remote address, so the
        # receive's own buffer is empty (length 0), as in C.
        for _ in range(count):
            empty = SGE(int(self._mr.buf), 0, int(self._mr.lkey))
            self._call("post_recv", self._qp.post_recv, RecvWR(wr_id=0, num_sge=1, sg=[empty]))

    def write_chunk(self, slot: int, data: memoryview | bytes, imm: int) -> None:
        """Sender: copy ``data`` into staging slot ``slot`` and RDMA-write it to the peer's slot."""
        from pyverbs.wr import SGE, SendWR

        peer = self._require_peer()
        if self.role is not ChannelRole.SENDER:
            raise InvalidInput("only the sender writes chunks")
        if not 0 <= slot < min(self.config.slots, peer.slots):
            raise InvalidInput(f"slot {slot} is outside the window of {min(self.config.slots, peer.slots)}")
        n = len(memoryview(data).cast("B"))
        if not 0 < n <= self.config.slot_bytes or not 0 <= imm < 1 << 32:
            raise InvalidInput(
                f"chunk of {n} bytes (imm {imm}) does not fit a {self.config.slot_bytes}-byte slot"
            )
        offset = slot * self.config.slot_bytes
        self._mr.write(bytes(data), n, offset)
        sge = SGE(int(self._mr.buf) + offset, n, int(self._mr.lkey))
        wr = SendWR(wr_id=slot, opcode=self._e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[sge], imm_data=imm)
        wr.set_wr_rdma(peer.rkey, peer.addr + slot * peer.slot_bytes)
        self._call("post_send", self._qp.post_send, wr)
        self._in_flight += 1

    @property
    def in_flight(self) -> int:
        """Sender: writes posted and not yet completed (each holds its staging slot)."""
        return self._in_flight

    def read_slot(self, slot: int, length: int) -> bytes:
        """Receiver: the bytes a completion announced in ``slot``."""
        if not 0 <= slot < self.config.slots or not 0 <= length <= self.config.slot_bytes:
            raise InvalidInput(f"slot {slot} / length {length} outside the landing region")
        return bytes(self._mr.read(length, slot * self.config.slot_bytes))

    def poll(self, timeout_s: float, *, max_completions: int = 16) -> list[RdmaCompletion]:
        """Completions available now, waiting up to ``timeout_s`` for the first one (busy poll)."""
        deadline = time.monotonic() + timeout_s
        while True:
            count, wcs = self._cq.poll(num_entries=max_completions)
            if count:
                return [self._completion(wc) for wc in wcs[:count]]
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no RDMA completion within {timeout_s:.3f} s")
            time.sleep(0)

    def close(self) -> None:
        for obj in (self._qp, self._mr, self._cq, self._pd, self._ctx):
            obj.close()

    def _completion(self, wc: Any) -> RdmaCompletion:
        e = self._e
        if wc.status != e.IBV_WC_SUCCESS:
            raise RdmaError(f"work completion failed with status {wc.status} (wr_id {wc.wr_id})")
        received = wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM
        if received:
            self.post_receives(1)  # keep the receive queue as deep as the window
        else:
            self._in_flight -= 1
        return RdmaCompletion(int(wc.wr_id), int(wc.imm_data) if received else 0, int(wc.byte_len), received)

    def _require_peer(self) -> RdmaEndpoint:
        if self._peer is None:
            raise InvalidInput("connect() the channel to its peer first")
        return self._peer

    @staticmethod
    def _call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            return fn(*args)
        except PyverbsError as exc:  # carries errno and the verbs message
            raise RdmaError(f"{what} failed: {exc}") from exc


class RdmaTransport:
    """Registry entry ``pddlink.transport.rdma:RdmaTransport`` (name "rdma").

    ``listen``/``connect`` check the fast path first and raise ``Unavailable`` with the reason
    (no pyverbs, no device) so the caller falls back to TCP. With a device they need the control
    link's ``RdmaSetup`` message to swap ``RdmaEndpoint`` bodies; until ``pddlink.wire`` carries it
    they say so instead of pretending."""

    name: ClassVar[str] = "rdma"

    @classmethod
    async def listen(cls, host: str, port: int, **_: Any) -> Any:
        raise cls._not_wired()

    @classmethod
    async def connect(cls, host: str, port: int, **_: Any) -> Any:
        raise cls._not_wired()

    @staticmethod
    def _not_wired() -> Unavailable:
        require_rdma()
        return Unavailable(
            "RDMA device present, but the control link has no RdmaSetup message yet to exchange"
            " queue-pair endpoints; use transport 'tcp' (RdmaChannel is the data path)"
        )
