"""The faults of ``pddlink chaos --engine vllm`` on a ``VllmTrio`` whose P->MD leg crosses a netlab
WAN, and what its sidecars hold (over their admin sockets, as an operator's tools would read it).

``VllmFaultRunner.apply(fault)`` (a thread: it blocks): ``KILL_RESTART`` of a role is ``kill -9`` of
that role's vLLM server and, ``duration_s`` later, the same server again beside the same sidecar;
the fault is over once the server serves and the router has it back in its pool. Right after the
restart, before the role sees new traffic, its sidecar's own count of what it holds is recorded
(``after_restart``: in-flight transfers, held slots, DRC blocks and leases: the engine-reset
invariant, 0 each). ``WAN_OUTAGE`` cuts the lab's WAN both ways for ``duration_s``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from harness.chaos.invariants import FaultRecord
from harness.chaos.schedule import Fault, FaultKind
from harness.vllm.pair import VllmPair
from pddlink.errors import PddlinkError

POOL_RETURN_S = 15.0  # the router's health probe runs each second


def say(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def sidecar_held(trio: VllmPair, role: str) -> dict[str, int]:
    """What ``role``'s sidecar holds for requests now: transfers in flight, region slots (and
    bytes), DRC blocks and leases (RLD/MD)."""
    st = trio.sides()[role].status()
    out = {
        "in_flight": int(st.get("in_flight", 0)),
        "held_slots": int(st.get("held_slots", 0)),
        "held_bytes": int(st.get("held_bytes", 0)),
    }
    if role != "p":
        out["drc_blocks"] = int(st.get("drc_blocks", 0))
        out["leases"] = int(trio.sides()[role].transfers().get("leases", 0))
    return out


def held_now(trio: VllmPair, router_in_flight: int) -> dict[str, Any]:
    """The report's ``held_after_s10``: KV slots every sidecar holds (kv_blocks), the DRC leases
    of RLD and MD (leases), the transfers every sidecar and the router still carry (waiting), and
    the slots' bytes."""
    held: dict[str, Any] = {"kv_blocks": 0, "leases": 0, "waiting": router_in_flight, "slot_bytes": 0}
    errors = {}
    for role in trio.sides():
        try:
            h = sidecar_held(trio, role)
        except (PddlinkError, OSError) as exc:
            errors[role] = str(exc)
            continue
        held["kv_blocks"] += h["held_slots"]
        held["slot_bytes"] += h["held_bytes"]
        held["waiting"] += h["in_flight"]
        held["leases"] += h.get("leases", 0)
    if errors:
        held["unreachable"] = errors
    return held


def p_legs(trio: VllmPair) -> dict[str, Any]:
    """P's per-leg counters (shipped, failed, bytes per destination)."""
    try:
        legs: dict[str, Any] = trio.sides()["p"].status().get("legs", {})
    except (PddlinkError, OSError):
        return {}
    return legs


def legs_moved(at: dict[str, dict[str, Any]], end: dict[str, Any]) -> dict[str, dict[str, bool]]:
    """Per restart, per leg of P: whether it shipped more after the restart than up to it."""
    return {
        role: {leg: end.get(leg, {}).get("shipped", 0) > c.get("shipped", 0) for leg, c in legs.items()}
        for role, legs in at.items()
    }


class VllmFaultRunner:
    def __init__(self, trio: VllmPair, usable: Callable[[str], bool], t0: float) -> None:
        """``usable(role)``: whether the router has the role in its pool now."""
        self.trio, self.usable, self.t0 = trio, usable, t0
        self.records: list[FaultRecord] = []
        self.after_restart: dict[str, dict[str, Any]] = {}  # role -> its sidecar, right after
        self.restarted: list[str] = []
        self.p_legs_at: dict[str, dict[str, Any]] = {}  # role -> P's per-leg counters at its restart

    def now(self) -> float:
        return time.monotonic() - self.t0

    def apply(self, fault: Fault) -> None:
        start = self.now()
        say(f"[chaos] {start:6.1f} s  fault {fault.name}")
        note = self._do(fault)
        self.records.append(FaultRecord(fault.name, fault.kind.value, fault.target, start, self.now(), note))
        say(f"[chaos] {self.now():6.1f} s  fault {fault.name} over {note}")

    def _do(self, fault: Fault) -> str:
        if fault.kind is FaultKind.KILL_RESTART:
            return self._kill_restart(fault.target, fault.duration_s)
        if fault.kind in (FaultKind.WAN_OUTAGE, FaultKind.ONE_WAY_CUT):
            lab = self.trio.lab  # type: ignore[attr-defined]
            direction = "both" if fault.kind is FaultKind.WAN_OUTAGE else "a_to_b"
            lab.set_outage(True, direction)
            try:
                time.sleep(fault.duration_s)
            finally:
                lab.set_outage(False)
            return ""
        return f"skipped: {fault.kind.value} is not in the vLLM schedule"

    def _kill_restart(self, role: str, down_s: float) -> str:
        start = self.now()
        try:
            up = self.trio.restart(role, down_s)
        except PddlinkError as exc:
            return f"restart failed: {exc.message}"
        held = sidecar_held(self.trio, role)  # the new engine has served nothing through it yet
        self.after_restart[role] = held
        self.p_legs_at[role] = p_legs(self.trio)
        self.restarted.append(role)
        note = f"vLLM restarted after {up:.1f} s; its sidecar then held {held}; "
        until = time.monotonic() + POOL_RETURN_S
        while time.monotonic() < until:
            if self.usable(role):
                return note + f"back in the router's pool after {self.now() - start:.1f} s"
            time.sleep(0.1)
        return note + f"not back in the router's pool {POOL_RETURN_S:g} s after its restart"
