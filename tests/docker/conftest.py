"""Rules for the container tests (marked ``docker``).

They need root, dockerd, docker-compose and debootstrap, and skip with the missing piece named
otherwise. In CI (``CI=true``) they run in their own step, ``scripts/ci-docker.sh`` (which installs
the engine, builds the images and sets ``PDDLINK_CI_DOCKER=1``), so the main test run skips them
instead of running them twice.
"""

from __future__ import annotations

import os
import shutil

import pytest


def engine_unavailable() -> str:
    """Why no container engine can run here ('' when one can)."""
    if os.geteuid() != 0:
        return "needs root (dockerd, TUN devices)"
    from netlab.compose.engine import find_tools
    from pddlink.errors import Unavailable

    try:
        find_tools()
    except Unavailable as exc:
        return exc.message
    if shutil.which("debootstrap") is None:
        return "debootstrap is missing (apt-get install debootstrap): the base image comes from it"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun: the relay container needs a TUN device"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("CI") == "true" and os.environ.get("PDDLINK_CI_DOCKER") != "1":
        reason = "in CI the container tests run in their own step (scripts/ci-docker.sh)"
    else:
        reason = engine_unavailable()
    if reason:
        for item in items:
            if item.get_closest_marker("docker") is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
