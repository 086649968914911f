"""Whether the vLLM beside this sidecar is still the one the sidecar's state belongs to (sans-I/O).

A sidecar holds state for its engine: MD's and RLD's landed transfers and the DRC that mirrors
vLLM's prefix cache, P's prepared transfers and their region slots. When vLLM is killed and started
again, none of it is the new engine's: the landed KV has no request to load it, the DRC claims
blocks the new cache never held (P's reservations then "match" and ship nothing, and MD's vLLM
finds the prefix missing), the slots stay taken. ``EngineWatch`` turns what the sidecar can observe
into two events, with ``now`` passed in:

    connected(conn, pid)   a control connection opened; ``pid`` is its peer (SO_PEERCRED), None
                           when the peer is in another PID namespace and cannot be watched
    exited(pid)            a watched peer process ended (its pidfd became readable)
    closed(conn)           a control connection closed

    -> EngineLost(reason)  the engine the state belongs to is gone: reset everything held for it
    -> EngineBack(pid)     a control connection from a new engine after a loss

Rules (one table, ``_LOST_ON``): a watched process that exits is the engine's death (the kernel
also closes its sockets, but a closed connection alone is not: the connector reopens one after an
error; and the kernel closes a killed process's sockets before its pidfd says it exited, so the
connections are often gone first). An unwatchable peer has only its connections to go by: when the
last of them closes, the engine is taken as gone (vLLM's connector keeps its two connections for
the engine's life). A loss
is reported once per engine: a second signal of the same death says nothing new. vLLM's KV events
starting over (a new publisher) are the DRC's own business (``pddlink.connector.kv_events``): they
come after the new engine's first connection, so they never end an engine's life here.

State: ``UNSEEN`` (no engine yet) -> ``UP`` (connected) -> ``LOST`` -> ``UP`` (a new engine's
first connection) ...
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EngineState(StrEnum):
    UNSEEN = "unseen"
    UP = "up"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class EngineLost:
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class EngineBack:
    pid: int | None
    at: float


EngineEvent = EngineLost | EngineBack

# the signals that end an engine's life, by the states they do it in (a signal in LOST is the
# same death seen twice; in UNSEEN there was no engine to lose)
_LOST_ON = {
    "exited": {EngineState.UP},
    "last_unwatched_closed": {EngineState.UP},
}


class EngineWatch:
    def __init__(self) -> None:
        self.state = EngineState.UNSEEN
        self._conns: dict[int, int | None] = {}  # open control connection -> peer pid (None: unwatched)
        self._engine: set[int] = set()  # the engine's processes: their connections may close first
        self._dead: set[int] = set()  # pids seen to exit (a late connection from one is ignored)
        self.losses = 0
        self.last_reason = ""
        self.lost_at: float | None = None

    @property
    def pids(self) -> set[int]:
        """The engine processes watched now."""
        return set(self._engine)

    def connected(self, conn: int, pid: int | None, now: float) -> list[EngineEvent]:
        if pid is not None and pid in self._dead:
            return []  # a connection the dead process opened just before it died
        self._conns[conn] = pid
        if pid is not None:
            self._engine.add(pid)
        if self.state is EngineState.UP:
            return []
        was_lost = self.state is EngineState.LOST
        self.state = EngineState.UP
        return [EngineBack(pid, now)] if was_lost else []

    def closed(self, conn: int, now: float) -> list[EngineEvent]:
        if conn not in self._conns:
            return []
        pid = self._conns.pop(conn)
        if pid is not None or any(p is None for p in self._conns.values()):
            return []  # a watched peer's death comes as ``exited``; other unwatched ones remain
        if any(p is not None for p in self._conns.values()):
            return []
        return self._lose("last_unwatched_closed", "the engine's control connections closed", now)

    def exited(self, pid: int, now: float) -> list[EngineEvent]:
        self._dead.add(pid)
        if pid not in self._engine:
            return []
        return self._lose("exited", f"the engine's process {pid} exited", now)

    def _lose(self, signal: str, reason: str, now: float) -> list[EngineEvent]:
        if self.state not in _LOST_ON[signal]:
            return []
        self.state = EngineState.LOST
        self._conns.clear()  # whatever else the dead engine had open is its too
        self._engine.clear()
        self.losses += 1
        self.last_reason, self.lost_at = reason, now
        return [EngineLost(reason, now)]

    def status(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "pids": sorted(self.pids),
            "connections": len(self._conns),
            "losses": self.losses,
            "last_loss": self.last_reason,
        }
