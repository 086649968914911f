"""What both relays of a lab share (netns: ``netlab.relay``; loopback: ``netlab.loopback``): the
control requests on the model, the owner's pidfd, and real-time wakeups. Its own module so that
neither relay imports the other for it."""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

from netlab.model import LinkModel
from netlab.profile import DIRECTIONS, parse_profile
from netlab.state import LabState
from netlab.tun_relay import TunRelay
from pddlink.errors import PddlinkError

RELAY_RT_PRIORITY = 10


def sharpen_timing() -> None:
    """Let the relay wake on time although the CPU is busy: real-time priority where allowed.

    A delayed packet is released when the relay wakes from ``select``; on a loaded machine an
    ordinary process can wake a millisecond late, which would add to every RTT. SCHED_FIFO (root)
    wakes it at once; the kernel's RT throttling still leaves other processes their share.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RELAY_RT_PRIORITY))
    except (PermissionError, OSError):
        with contextlib.suppress(PermissionError, OSError):
            os.nice(-10)


def owner_fd(state: LabState) -> int | None:
    """A pidfd that becomes readable when the lab's owner exits (None: no owner)."""
    if not state.owner_pid:
        return None
    try:
        return os.pidfd_open(state.owner_pid)
    except ProcessLookupError:
        raise PddlinkError(f"owner process {state.owner_pid} is already gone") from None


class ControlHandler:
    """Applies control requests to the model; ``stopping`` ends the loop."""

    def __init__(self, model: LinkModel, relay: TunRelay | None, clock: Any) -> None:
        self.model, self.relay, self.clock = model, relay, clock
        self.stopping = False

    def __call__(self, req: dict[str, Any]) -> dict[str, Any]:
        op, now = req.get("op"), self.clock()
        if op == "status":
            cut = {d: self.model.is_cut(d, now) for d in DIRECTIONS}
            left = self.model.manual_left_s(now)
            return {
                "ok": True,
                "profile": self.model.profile.name,
                "uptime_s": now - self.model.start_s,
                "outage": any(cut.values()),
                "cut": cut,
                "outage_left_s": left if math.isfinite(left) else None,
                "stats": self.model.stats(),
                **(self.relay.timing() if self.relay is not None else {}),
            }
        direction = str(req.get("direction", "both"))
        if op == "outage":
            seconds = req.get("seconds")
            if seconds is not None and (not isinstance(seconds, int | float) or seconds < 0):
                return {"ok": False, "error": f"outage seconds {seconds!r} must be a number >= 0 or null"}
            self.model.set_outage(now, None if seconds is None else float(seconds), direction)
            if self.relay is not None:
                self.relay.drop_in_flight(direction)
            return {"ok": True}
        if op == "restore":
            self.model.clear_outage(direction)
            return {"ok": True}
        if op == "profile":
            profile = parse_profile(str(req.get("toml", "")), name=str(req.get("name", "live")))
            if profile.mtu_bytes != self.model.profile.mtu_bytes:
                return {"ok": False, "error": "profile field mtu_bytes: cannot change on a running lab"}
            self.model.set_profile(profile)
            return {"ok": True, "profile": profile.name}
        if op == "stop":
            self.stopping = True
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}
