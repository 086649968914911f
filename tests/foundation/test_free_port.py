"""``harness.cluster.free_port``: a port it handed out is not handed out again by this process, even
when the kernel offers it again (the same port to two ``bind(0)`` calls once the first socket is
closed), so two roles of one cluster, or a cluster and its predecessor's lingering process in a
netlab namespace, never get one port."""

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
    monkeypatch.setattr(cluster.socket, "socket", _Offered)
    _Offered.ports = [41000, 41000, 41000, 41001, 41000, 41002]
    assert [cluster.free_port(), cluster.free_port(), cluster.free_port()] == [41000, 41001, 41002]


def test_real_ports_are_distinct_and_bindable() -> None:
    ports = [cluster.free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free
