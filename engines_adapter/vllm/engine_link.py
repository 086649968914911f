"""The asyncio side of ``EngineWatch``: the control server's connections in, the engine's death out.

``EngineMonitor`` is the control server's ``ConnectionWatch``: each connection's peer process is
watched through a pidfd (readable once the process has exited, zombie or reaped alike: no polling,
no race with the kernel closing its sockets first), and what ``EngineWatch`` concludes is handed to
``on_lost(reason)`` (the sidecar's reset) or logged (a new engine back). Linux only for the pidfd;
elsewhere, or for a peer in another PID namespace, the connections alone decide (see
``engine_watch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from engines_adapter.vllm.engine_watch import EngineBack, EngineEvent, EngineLost, EngineWatch

log = logging.getLogger("pddlink.vllm.engine")


class EngineMonitor:
    def __init__(
        self, on_lost: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.watch = EngineWatch()
        self.on_lost, self.clock = on_lost, clock
        self._pidfds: dict[int, int] = {}  # watched pid -> its pidfd

    def opened(self, conn: int, pid: int | None) -> None:
        if pid is not None and pid not in self._pidfds and not self._watch_pid(pid):
            pid = None  # cannot be watched: its connections decide
        self._apply(self.watch.connected(conn, pid, self.clock()))

    def closed(self, conn: int) -> None:
        self._apply(self.watch.closed(conn, self.clock()))

    def _watch_pid(self, pid: int) -> bool:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already: the connection was its last act
            asyncio.get_running_loop().call_soon(self._exited, pid)
            return True
        except (OSError, AttributeError):
            return False
        self._pidfds[pid] = fd
        asyncio.get_running_loop().add_reader(fd, self._exited, pid)
        return True

    def _exited(self, pid: int) -> None:
        self._unwatch(pid)
        self._apply(self.watch.exited(pid, self.clock()))

    def _unwatch(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _apply(self, events: list[EngineEvent]) -> None:
        for ev in events:
            if isinstance(ev, EngineLost):
                log.warning("vLLM engine lost (%s): resetting what the sidecar held for it", ev.reason)
                self.on_lost(ev.reason)
            elif isinstance(ev, EngineBack):
                log.warning("vLLM engine back (process %s)", ev.pid)

    def close(self) -> None:
        for pid in list(self._pidfds):
            self._unwatch(pid)
