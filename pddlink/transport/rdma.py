"""RDMA fast path (pyverbs): reliable-connected QPs, registered regions, chunk writes with immediate.

Where it sits. Inside a datacenter P ships prompt KV to RelayDecode over RDMA; control messages
(hello, RDMA set-up, transfer begin/end, acks, slot credits, handoff) stay on the TCP control link
and the sans-I/O transfer machine (``pddlink.transfer``) still owns windows, acks and digests. Only
chunk frames move by RDMA. This module is the verbs layer: availability (``rdma_available()`` says
why not), the channel config and ``RdmaChannel``. The set-up exchange is
``pddlink.wire.rdma_setup``; the link that uses it is ``rdma_session``; the lanes are
``rdma_lanes``.

Lifecycle of one channel (one RC queue pair per link, sender -> receiver)::

    receiver                                   sender
    RdmaChannel(RECEIVER, config)              RdmaChannel(SENDER, config)
      landing region: slots x slot_bytes,        staging region: slots x slot_bytes,
      REMOTE_WRITE; post_receives(slots)         LOCAL_WRITE
    endpoint() --- control link: RdmaSetup (qpn, psn, lid, gid, rkey, addr, slots, slot_bytes) --->
                                               connect(peer)   INIT -> RTR -> RTS
    <--------------------------------------------------------------- RdmaSetup(sender endpoint)
    connect(peer)  INIT -> RTR -> RTS
    RdmaReady ------------------------------------------------------------------------------------>
                                               write_frame(slot, frame parts, imm=slot)
                                               = RDMA WRITE WITH IMMEDIATE into the peer's slot
    poll_nowait() -> RdmaCompletion(imm=slot, byte_len)
    read_slot(slot, n) -> the encoded Chunk frame; RdmaCredit(slot) on the control link frees it
    close()                                    close()

A write-with-immediate consumes one posted receive and raises one completion on the receiver
carrying the slot index (the channel re-posts the receive), so no "chunk landed" message is needed;
the chunk's transfer id, index, offset and checksum travel inside the frame written to the slot.

Install (see the project report): ``apt-get install libnl-3-dev libnl-route-3-dev cmake`` then
``pip install 'pddlink[rdma]'`` (pyverbs >= 59 builds with Cython 3), or the distribution package
``python3-pyverbs`` for the system Python.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pddlink.errors import (
    ConfigError,
    DeadlineExceeded,
    ErrorCode,
    InvalidInput,
    LocalError,
    PddlinkError,
    Unavailable,
)
from pddlink.wire.rdma_messages import MAX_SLOTS, ChannelRole, PathMtu, RdmaEndpoint

__all__ = [
    "ChannelRole",
    "RdmaChannel",
    "RdmaCompletion",
    "RdmaConfig",
    "RdmaEndpoint",
    "RdmaError",
    "gid_bytes",
    "rdma_available",
    "require_rdma",
]

log = logging.getLogger(__name__)
INFINIBAND_SYSFS: Final = Path("/sys/class/infiniband")
INSTALL_HINT: Final = (
    "install pyverbs: apt-get install libnl-3-dev libnl-route-3-dev cmake && pip install 'pddlink[rdma]'"
    " (or apt-get install python3-pyverbs for the system Python)"
)
HOP_LIMIT: Final = 64
# libibverbs ABI values (enum ibv_access_flags): what INIT grants both ends of a channel
IBV_ACCESS_LOCAL_WRITE: Final = 1
IBV_ACCESS_REMOTE_WRITE: Final = 2
QP_ACCESS_FLAGS: Final = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
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
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ConfigError(f"rdma.slots={self.slots}: must be 1-{MAX_SLOTS}")
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
    """One work completion: a landed frame (receiver: ``imm`` = its slot) or a finished write."""

    wr_id: int
    imm: int
    byte_len: int
    received: bool  # True on the receiver (RECV_RDMA_WITH_IMM), False for the sender's own write


def qp_init_attr(config: RdmaConfig) -> Any:
    """The pyverbs ``QPAttr`` for RESET -> INIT: port, P_Key index 0 and the access flags
    (``QP_ACCESS_FLAGS``) without which the queue pair refuses the peer's RDMA writes."""
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=config.port_num)
    attr.pkey_index = 0
    attr.qp_access_flags = QP_ACCESS_FLAGS
    return attr


def qp_attr_towards(peer: RdmaEndpoint, config: RdmaConfig, psn: int) -> Any:
    """The pyverbs ``QPAttr`` that takes an RC queue pair to RTS towards ``peer`` (no device needed
    to build it, so a host with pyverbs but no NIC can still check it)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=config.port_num)
    attr.dest_qp_num = peer.qp_num
    attr.path_mtu = min(config.path_mtu, int(peer.path_mtu))
    attr.rq_psn, attr.sq_psn = peer.psn, psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.min_rnr_timer, attr.timeout = config.min_rnr_timer, config.timeout
    attr.retry_cnt, attr.rnr_retry = config.retry_count, config.rnr_retry
    # hop_limit 64: RoCE v2 packets may be routed (pyverbs' default of 1 stops at the first router)
    route = GlobalRoute(dgid=GID(peer.gid_text), sgid_index=config.gid_index, hop_limit=HOP_LIMIT)
    attr.ah_attr = AHAttr(port_num=config.port_num, is_global=1, gr=route, dlid=peer.lid)
    return attr


def write_request(wr_id: int, local: tuple[int, int, int], remote: tuple[int, int], imm: int) -> Any:
    """A signalled RDMA WRITE WITH IMMEDIATE of ``local`` = (address, length, lkey) to ``remote`` =
    (address, rkey)."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    sge = SGE(*local)
    wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[sge], imm_data=imm)
    wr.set_wr_rdma(remote[1], remote[0])
    return wr


class RdmaChannel:
    """One RC queue pair with its registered region, protection domain and completion queue.

    Not thread-safe; one owner (the transport's data task) drives it. Every wait is bounded by a
    ``timeout_s`` and raises ``DeadlineExceeded``; a failed completion raises ``RdmaError``."""

    def __init__(self, role: ChannelRole, config: RdmaConfig | None = None) -> None:
        require_rdma()
        self.role = role
        self.config = config or RdmaConfig()
        self._psn = secrets.randbelow(1 << 24)
        self._peer: RdmaEndpoint | None = None
        self._in_flight = 0
        self._opened: list[Any] = []  # verbs objects in creation order; close() undoes them
        try:
            self._open()
        except BaseException:
            self.close()  # a partly built channel must not keep its context, PD, CQ or MR
            raise

    def _open(self) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cfg, call = self.config, self._call
        self._e = e
        self.device = name = cfg.device or call("list devices", list_devices_pyverbs)[0]
        self._ctx = self._keep(call(f"open device {name}", Context, name=name))
        self._pd = self._keep(call("allocate PD", PD, self._ctx))
        depth = cfg.slots + 1
        self._cq = self._keep(call("create CQ", CQ, self._ctx, 2 * depth, None, None, 0))
        access = e.IBV_ACCESS_LOCAL_WRITE
        if self.role is ChannelRole.RECEIVER:
            access |= e.IBV_ACCESS_REMOTE_WRITE
        self._mr = self._keep(call("register MR", MR, self._pd, cfg.region_bytes, access))

        def create_qp() -> Any:  # created and moved to INIT with the access a peer's writes need
            cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=1)
            return QP(self._pd, init, qp_init_attr(cfg))

        self._qp = self._keep(call("create QP", create_qp))

    def _keep(self, obj: Any) -> Any:
        self._opened.append(obj)
        return obj

    def endpoint(self) -> RdmaEndpoint:
        """This side's set-up parameters, to send over the control link."""
        cfg = self.config
        port = self._call("query port", self._ctx.query_port, cfg.port_num)
        gid = gid_bytes(str(self._call("query GID", self._ctx.query_gid, cfg.port_num, cfg.gid_index).gid))
        receiver = self.role is ChannelRole.RECEIVER
        return RdmaEndpoint(
            self.role, int(self._qp.qp_num), self._psn, int(port.lid), cfg.port_num,
            PathMtu(min(cfg.path_mtu, int(port.active_mtu))), gid,
            rkey=int(self._mr.rkey) if receiver else 0, addr=int(self._mr.buf) if receiver else 0,
            slots=cfg.slots if receiver else 0, slot_bytes=cfg.slot_bytes if receiver else 0,
        )  # fmt: skip

    def connect(self, peer: RdmaEndpoint) -> None:
        """Move the queue pair INIT -> RTR -> RTS towards ``peer``."""
        if peer.role is self.role:
            raise InvalidInput(f"both ends of an RDMA channel claim the {self.role.name} role")
        if self.role is ChannelRole.SENDER and (peer.slots == 0 or peer.slot_bytes == 0):
            raise InvalidInput("the peer's endpoint describes no landing slots")
        self._call("modify QP to RTS", lambda: self._qp.to_rts(qp_attr_towards(peer, self.config, self._psn)))
        self._peer = peer

    def post_receives(self, count: int) -> None:
        """Receiver: one posted receive per chunk the sender may write (each write-with-imm uses one)."""
        from pyverbs.wr import SGE, RecvWR

        # pyverbs wants one SGE per WR; a write-with-imm lands at the remote address, so the
        # receive's own buffer is empty (length 0), as in C.
        def post_one() -> None:
            empty = SGE(int(self._mr.buf), 0, int(self._mr.lkey))
            self._qp.post_recv(RecvWR(wr_id=0, num_sge=1, sg=[empty]))

        for _ in range(count):
            self._call("post_recv", post_one)

    def write_frame(self, slot: int, parts: Sequence[bytes | memoryview], imm: int) -> None:
        """Sender: copy ``parts`` (a frame's header+body and payload) into staging slot ``slot`` and
        RDMA-write them, as one write with immediate ``imm``, to the peer's slot ``slot``."""
        peer = self._require_peer()
        if self.role is not ChannelRole.SENDER:
            raise InvalidInput("only the sender writes chunks")
        window = min(self.config.slots, peer.slots)
        if not 0 <= slot < window:
            raise InvalidInput(f"slot {slot} is outside the window of {window}")
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(v.nbytes for v in views)
        if not 0 < n <= min(self.config.slot_bytes, peer.slot_bytes) or not 0 <= imm < 1 << 32:
            raise InvalidInput(f"frame of {n} bytes (imm {imm}) does not fit a {peer.slot_bytes}-byte slot")
        offset = start = slot * self.config.slot_bytes
        for view in views:  # pyverbs copies from bytes only
            self._call("write staging slot", self._mr.write, view.tobytes(), view.nbytes, offset)
            offset += view.nbytes
        local = (int(self._mr.buf) + start, n, int(self._mr.lkey))
        remote = (peer.addr + slot * peer.slot_bytes, peer.rkey)
        self._call("post_send", lambda: self._qp.post_send(write_request(slot, local, remote, imm)))
        self._in_flight += 1

    @property
    def in_flight(self) -> int:
        """Sender: writes posted and not yet completed (each holds its staging slot)."""
        return self._in_flight

    def read_slot(self, slot: int, length: int) -> bytes:
        """Receiver: the bytes a completion announced in ``slot``."""
        if not 0 <= slot < self.config.slots or not 0 <= length <= self.config.slot_bytes:
            raise InvalidInput(f"slot {slot} / length {length} outside the landing region")
        return bytes(self._call("read landing slot", self._mr.read, length, slot * self.config.slot_bytes))

    def poll(self, timeout_s: float, *, max_completions: int = 16) -> list[RdmaCompletion]:
        """Completions available now, waiting up to ``timeout_s`` for the first one (busy poll)."""
        deadline = time.monotonic() + timeout_s
        while True:
            count, wcs = self._call("poll CQ", self._cq.poll, max_completions)
            if count:
                return [self._completion(wc) for wc in wcs[:count]]
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no RDMA completion within {timeout_s:.3f} s")
            time.sleep(0)

    def poll_nowait(self, max_completions: int = 16) -> list[RdmaCompletion]:
        """Completions available now (possibly none): for an event loop that must not block."""
        count, wcs = self._call("poll CQ", self._cq.poll, max_completions)
        return [self._completion(wc) for wc in wcs[:count]] if count else []

    def close(self) -> None:
        """Release the verbs objects, newest first (QP, MR, CQ, PD, context); idempotent."""
        while self._opened:
            obj = self._opened.pop()
            try:
                obj.close()
            except Exception as exc:  # keep closing the rest; the device may already be gone
                log.warning("closing RDMA %s failed: %s", type(obj).__name__, exc)

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
    def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` with every failure typed: ``PyverbsError`` (errno and the verbs message)
        and anything else pyverbs raises (TypeError, ValueError, IndexError...) -> ``RdmaError``."""
        try:
            return fn(*args, **kwargs)
        except PddlinkError:
            raise
        except Exception as exc:
            raise RdmaError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
