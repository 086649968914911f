"""vLLM tests: marked ``vllm``; skipped with the reason where vLLM is not installed."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    if os.environ.get("PDDLINK_REQUIRE_VLLM"):
        raise pytest.UsageError("PDDLINK_REQUIRE_VLLM is set but vLLM is not installed (scripts/setup.sh)")
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install 'pddlink[vllm]' or scripts/setup.sh)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
