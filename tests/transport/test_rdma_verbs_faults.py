"""``RdmaChannel`` against a stand-in pyverbs that fails on request.

A verbs call that fails (an errno from the kernel, a ``PyverbsUserError``, a ``TypeError`` from a
pyverbs of another version) cannot be produced for real on this machine: it has no RDMA device and
the venv has no pyverbs. So these tests put a small stand-in for the pyverbs modules into
``sys.modules`` (restored after each test) and check what the channel does with it: the INIT
attributes it asks for, that every failure comes out as ``RdmaError`` (which the link turns into a
TCP fallback), and that a half-built channel closes what it had opened. The real library is
checked in test_rdma.py (skipped without pyverbs) and on a device by the loopback tests.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from pddlink.transport.rdma import QP_ACCESS_FLAGS, ChannelRole, RdmaChannel, RdmaConfig, RdmaError
from pddlink.wire import PathMtu, RdmaEndpoint


class PyverbsError(Exception):
    pass


class FakeVerbs:
    """The pyverbs calls RdmaChannel makes; ``fail[name]`` is raised by the call of that name."""

    def __init__(self) -> None:
        self.fail: dict[str, BaseException] = {}
        self.created: list[Any] = []
        self.init_attr: Any = None
        self.rts_attr: Any = None

    def maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def modules(self) -> dict[str, types.ModuleType]:
        verbs = self

        class Obj:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                verbs.maybe_fail(type(self).__name__)
                self.args, self.closed = args, False
                self.__dict__.update(kwargs)
                verbs.created.append(self)

            def close(self) -> None:
                self.closed = True

        class Context(Obj):
            def query_port(self, port: int) -> Any:
                verbs.maybe_fail("query_port")
                return types.SimpleNamespace(lid=0, active_mtu=5)

            def query_gid(self, port: int, index: int) -> Any:
                verbs.maybe_fail("query_gid")
                return types.SimpleNamespace(gid="fe80:0000:0000:0000:0202:c9ff:fe01:2345")

        class PD(Obj):
            pass

        class CQ(Obj):
            def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
                verbs.maybe_fail("poll")
                return 0, []

        class MR(Obj):
            buf, lkey, rkey = 1 << 20, 11, 12

            def write(self, data: bytes, length: int, offset: int) -> None:
                verbs.maybe_fail("write")

            def read(self, length: int, offset: int) -> bytes:
                verbs.maybe_fail("read")
                return bytes(length)

        class QP(Obj):
            qp_num = 0x42

            def __init__(self, pd: Any, init: Any, attr: Any) -> None:
                super().__init__(pd, init, attr)
                verbs.init_attr = attr

            def to_rts(self, attr: Any) -> None:
                verbs.maybe_fail("to_rts")
                verbs.rts_attr = attr

            def post_recv(self, wr: Any) -> None:
                verbs.maybe_fail("post_recv")

            def post_send(self, wr: Any) -> None:
                verbs.maybe_fail("post_send")

        class Plain:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                verbs.maybe_fail(type(self).__name__)
                self.args = args
                self.__dict__.update(kwargs)

            def set_wr_rdma(self, rkey: int, addr: int) -> None:
                pass

        def plain(name: str) -> type:
            return type(name, (Plain,), {})

        names = {
            "pyverbs": {},
            "pyverbs.pyverbs_error": {"PyverbsError": PyverbsError},
            "pyverbs.enums": {
                "IBV_ACCESS_LOCAL_WRITE": 1, "IBV_ACCESS_REMOTE_WRITE": 2, "IBV_QPT_RC": 2,
                "IBV_WC_SUCCESS": 0, "IBV_WC_RECV_RDMA_WITH_IMM": 129, "IBV_WR_RDMA_WRITE_WITH_IMM": 0,
            },
            "pyverbs.device": {
                "Context": Context,
                "get_device_list": lambda: [types.SimpleNamespace(name=b"fake0")],
            },
            "pyverbs.pd": {"PD": PD},
            "pyverbs.cq": {"CQ": CQ},
            "pyverbs.mr": {"MR": MR},
            "pyverbs.qp": {n: plain(n) for n in ("QPAttr", "QPCap", "QPInitAttr")} | {"QP": QP},
            "pyverbs.addr": {n: plain(n) for n in ("GID", "GlobalRoute", "AHAttr")},
            "pyverbs.wr": {n: plain(n) for n in ("SGE", "RecvWR", "SendWR")},
        }  # fmt: skip
        out = {name: types.ModuleType(name) for name in names}
        for name, attrs in names.items():
            for key, value in attrs.items():
                setattr(out[name], key, value)
            if "." in name:
                setattr(out["pyverbs"], name.split(".")[1], out[name])
        return out


@pytest.fixture
def verbs(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeVerbs]:
    fake = FakeVerbs()
    for name, module in fake.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    yield fake


CONFIG = RdmaConfig(slots=4, slot_bytes=1 << 16)
GID = bytes.fromhex("fe800000000000000202c9fffe012345")
RECEIVER = RdmaEndpoint(ChannelRole.RECEIVER, 7, 1, 0, 1, PathMtu.MTU_4096, GID, 9, 1 << 30, 4, 1 << 16)
SENDER = RdmaEndpoint(ChannelRole.SENDER, 8, 2, 0, 1, PathMtu.MTU_4096, GID)


@pytest.mark.parametrize("role", list(ChannelRole))
def test_the_queue_pair_enters_init_with_remote_write_access(verbs: FakeVerbs, role: ChannelRole) -> None:
    channel = RdmaChannel(role, CONFIG)
    try:
        attr = verbs.init_attr
        assert attr.qp_access_flags == QP_ACCESS_FLAGS == 1 | 2  # LOCAL_WRITE | REMOTE_WRITE
        assert (attr.port_num, attr.pkey_index) == (CONFIG.port_num, 0)
        assert channel.endpoint().qp_num == 0x42
    finally:
        channel.close()


@pytest.mark.parametrize("stage", ["PD", "CQ", "MR", "QP", "QPInitAttr"])
@pytest.mark.parametrize("error", [PyverbsError, TypeError])
def test_a_failed_constructor_closes_what_it_opened_and_raises_rdma_error(
    verbs: FakeVerbs, stage: str, error: type[Exception]
) -> None:
    verbs.fail[stage] = error(f"{stage}: Failed to allocate. Errno: 12")
    with pytest.raises(RdmaError, match=f"{stage}: Failed to allocate"):
        RdmaChannel(ChannelRole.RECEIVER, CONFIG)
    opened = [o for o in verbs.created if hasattr(o, "closed")]
    assert opened and all(o.closed for o in opened)  # the context at least was opened, and closed


@pytest.mark.parametrize(
    ("call", "action"),
    [
        ("query_port", lambda ch: ch.endpoint()),
        ("query_gid", lambda ch: ch.endpoint()),
        ("to_rts", lambda ch: ch.connect(RECEIVER)),
        ("GID", lambda ch: ch.connect(RECEIVER)),  # building the RTR/RTS attributes
        ("poll", lambda ch: ch.poll_nowait()),
        ("poll", lambda ch: ch.poll(0.01)),
    ],
)
def test_every_verbs_failure_of_a_sender_is_an_rdma_error(verbs: FakeVerbs, call: str, action: Any) -> None:
    channel = RdmaChannel(ChannelRole.SENDER, CONFIG)
    try:
        verbs.fail[call] = ValueError(f"{call} went wrong")
        with pytest.raises(RdmaError, match=f"{call} went wrong"):
            action(channel)
    finally:
        channel.close()


@pytest.mark.parametrize("call", ["write", "post_send", "SGE"])
def test_a_failed_write_is_an_rdma_error(verbs: FakeVerbs, call: str) -> None:
    channel = RdmaChannel(ChannelRole.SENDER, CONFIG)
    try:
        channel.connect(RECEIVER)
        assert verbs.rts_attr.ah_attr.gr.hop_limit == 64  # RoCE v2 may be routed
        verbs.fail[call] = PyverbsError(f"{call} failed. Errno: 5")
        with pytest.raises(RdmaError, match=call):
            channel.write_frame(0, (b"head", b"payload"), imm=0)
        assert channel.in_flight == 0
    finally:
        channel.close()


@pytest.mark.parametrize("call", ["read", "post_recv"])
def test_a_failed_receive_side_call_is_an_rdma_error(verbs: FakeVerbs, call: str) -> None:
    channel = RdmaChannel(ChannelRole.RECEIVER, CONFIG)
    try:
        channel.connect(SENDER)
        verbs.fail[call] = OSError(f"{call} failed")
        with pytest.raises(RdmaError, match=call):
            channel.read_slot(0, 10) if call == "read" else channel.post_receives(1)
    finally:
        channel.close()
    channel.close()  # idempotent
