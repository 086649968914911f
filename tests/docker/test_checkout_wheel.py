"""The wheel the images install (``netlab.compose.images.build_checkout_wheel``) holds the checkout as
it is: setuptools stages modules in ``build/lib.*`` and never prunes that folder, so a module
deleted from the tree (``sidecar/vllm_daemon.py`` this week) stayed in every image built after."""

from __future__ import annotations

import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from netlab.compose.images import REPO, build_checkout_wheel

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def test_a_module_gone_from_the_tree_is_not_in_the_wheel(tmp_path: Path) -> None:
    staged = (
        REPO
        / "build"
        / f"lib.{sysconfig.get_platform()}-cpython-{sys.version_info.major}{sys.version_info.minor}"
    )
    stale = staged / "sidecar" / "stale_module_of_a_test.py"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("raise ImportError('deleted from the tree')\n")
    try:
        wheel = build_checkout_wheel(tmp_path / "wheel")
        names = set(zipfile.ZipFile(wheel).namelist())
    finally:
        stale.unlink(missing_ok=True)
    assert "sidecar/daemon.py" in names and "engines_adapter/bridge.py" in names
    assert "sidecar/stale_module_of_a_test.py" not in names
