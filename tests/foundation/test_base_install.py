"""The router and the reference-engine sidecar run on the base install: none of the ``vllm`` extra's
packages (vLLM, httpx, pyzmq, msgspec, transformers) is imported on their paths. The container lab's
router image has only the base install; a router module that imported httpx at the top once made
that router exit at start, which only the container tests (CI's last phase) saw."""

from __future__ import annotations

import subprocess
import sys

import pytest

EXTRA = ("vllm", "httpx", "zmq", "msgspec", "transformers")
# what ``pddlink router`` and ``pddlink sidecar`` import to serve the reference engine
MODULES = ("router.api", "router.openai_api", "router.openai_job", "pddlink.cli.router", "sidecar.daemon")


@pytest.mark.parametrize("module", MODULES)
def test_imports_without_the_vllm_extra(module: str) -> None:
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in EXTRA)  # import raises ImportError
    code = f"import sys; {blocked}; import {module}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
