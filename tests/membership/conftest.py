"""Fixtures: ``etcd_server``, one real etcd for the session (tests use their own cluster names, so
they never see each other's keys), and ``own_etcd``, a server of the test's own for tests that stop
it. Both skip where etcd is not installed (``_etcd_server.etcd_binary``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _etcd_server import EtcdServer


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd") / "data") as server:
        yield server


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path / "etcd-data") as server:
        yield server
