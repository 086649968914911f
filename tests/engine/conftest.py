"""Engine tests run torch on one thread (as each engine does in the sidecar): on a shared 2-core
machine intra-op threads only contend, and one thread makes the timing budget predictable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
