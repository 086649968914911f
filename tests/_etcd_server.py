"""The tests' etcd: ``harness.etcd_server.EtcdServer`` (a real etcd from Debian's ``etcd-server``,
its own process on loopback, free ports, stop / start / pause / resume), except that a machine
without the binary skips the test instead of failing it, unless ``PDDLINK_REQUIRE_ETCD=1`` (CI
installs it through scripts/setup.sh, and a missing binary must fail there).

Use from any test directory (``tests/`` is on ``sys.path`` through ``tests/conftest.py``)::

    from _etcd_server import EtcdServer, etcd_binary
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import etcd_server
from harness.etcd_server import EtcdMissing


def etcd_binary() -> str:
    try:
        return etcd_server.etcd_binary()
    except EtcdMissing as exc:
        if os.environ.get("PDDLINK_REQUIRE_ETCD") == "1":
            pytest.fail(f"PDDLINK_REQUIRE_ETCD=1 but {exc}")
        pytest.skip(str(exc))


class EtcdServer(etcd_server.EtcdServer):
    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        super().__init__(data_dir, binary or etcd_binary())
