"""Shared test fixtures and the rules for marked tests.

Tests marked ``root`` need root (network namespaces, TUN devices) and skip with that reason elsewhere.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip_root = pytest.mark.skip(reason="needs root: network namespaces and TUN devices")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip_root)
