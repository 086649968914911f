"""The one timer of a sans-I/O machine's asyncio driver.

A machine says when it next needs time (``get_timer()``: monotonic seconds, or None); its driver
``arm``s that deadline after every step, which replaces the previous one, and the callback gets the
time it fired at, to pass to ``handle_timer(now)``. ``close`` when the driver ends: the timer holds
its driver's bound method, so driver and timer are a reference cycle, and a cycle is freed only by
the cyclic GC, which runs rarely in a quiet process; ``close`` breaks it, so an ended transfer's
driver (and the payload its sender holds) is freed at once (issue 16: a P kept ~90 ended transfers'
KV, 230 MiB, in such cycles in quiet).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class MachineTimer:
    def __init__(self, fire: Callable[[float], None]) -> None:
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, when: float | None) -> None:
        """Fire at ``when`` (``time.monotonic()`` seconds; past: at once), or never (None)."""
        self.cancel()
        if when is not None and self._fire is not _ended:
            delay = max(0.0, when - time.monotonic())
            self._handle = asyncio.get_running_loop().call_later(delay, self._expired)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def close(self) -> None:
        """Cancel, and forget the callback: ``arm`` does nothing after this."""
        self.cancel()
        self._fire = _ended

    def _expired(self) -> None:
        self._handle = None
        self._fire(time.monotonic())


def _ended(now: float) -> None:
    """A closed timer's callback (never called: ``arm`` ignores a closed timer)."""
