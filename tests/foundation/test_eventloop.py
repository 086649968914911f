"""The services' event-loop choice: uvloop when it imports, asyncio otherwise, and an ImportError
raised inside a running service is that service's error (it is not restarted on the other loop)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pddlink import eventloop


def test_an_import_error_inside_the_service_propagates_and_the_service_runs_once() -> None:
    runs: list[str] = []

    async def service() -> None:
        runs.append(type(asyncio.get_running_loop()).__module__)
        raise ImportError("a module the service needs")

    with pytest.raises(ImportError, match="a module the service needs"):
        eventloop.run(service())
    assert len(runs) == 1


def test_without_uvloop_the_service_runs_on_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now raises ImportError

    async def service() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert eventloop.run(service()).startswith("asyncio")


def test_uvloop_is_used_where_installed() -> None:
    pytest.importorskip("uvloop")

    async def service() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert eventloop.run(service()).startswith("uvloop")
    assert eventloop.run(service(), prefer_uvloop=False).startswith("asyncio")
