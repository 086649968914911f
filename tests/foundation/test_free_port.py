"""``harness.cluster.free_port``: a port it handed out is not handed out again by this process, even
when the kernel offers it again (the same port to two ``bind(0)`` calls once the first socket is
closed), so two roles of one cluster, or a cluster and its predecessor's lingering process in a
netlab namespace, never get one port; and it hands out ports below the kernel's ephemeral range,
which no outgoing connection takes as its source port."""

from __future__ import annotations

import socket
from typing import Any, ClassVar

import pytest

from harness import cluster


class _Offered:
    """A socket whose ``bind(0)`` gets the next port of ``ports`` (what a kernel might offer)."""

    ports: ClassVar[list[int]] = []

    def __init__(self, *args: Any) -> None:
        self.port = 0

    def __enter__(self) -> _Offered:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, addr: tuple[str, int]) -> None:
        self.port = _Offered.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_offered_twice_is_handed_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "_ISSUED", type(cluster._ISSUED)(maxlen=16))
    monkeypatch.setattr(cluster, "FREE_PORTS", (40000, 0))  # no room below the ephemeral range
    monkeypatch.setattr(cluster.socket, "socket", _Offered)
    _Offered.ports = [41000, 41000, 41000, 41001, 41000, 41002]
    assert [cluster.free_port(), cluster.free_port(), cluster.free_port()] == [41000, 41001, 41002]


def test_real_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """Below it, no connection the cluster's processes open takes one as its source port before
    its server binds it."""
    ports = [cluster.free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    low, _ = cluster._ephemeral_range()
    assert all(cluster.FREE_PORTS[0] <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        assert not cluster._bindable(ports[0])
