"""The one timer of a sans-I/O machine's asyncio driver.

A machine says when it next needs time (``get_timer()``: monotonic seconds, or None); its driver
``arm``s that deadline after every step, which replaces the previous one, and the callback gets the
time it fired at, to pass to ``handle_timer(now)``. ``cancel`` when the driver ends.
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
        if when is not None:
            delay = max(0.0, when - time.monotonic())
            self._handle = asyncio.get_running_loop().call_later(delay, self._expired)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expired(self) -> None:
        self._handle = None
        self._fire(time.monotonic())
