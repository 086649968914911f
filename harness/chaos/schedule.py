"""The fault schedule of ``pddlink chaos``: what goes wrong, when, for how long.

A fault fires when a share of the load has ended (``at_share``), not at a wall-clock time, so the
schedule spreads over the run whatever this machine's speed. Pure data; ``harness.chaos.run``
applies each fault to the deployment.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pddlink.errors import ConfigError


class FaultKind(Enum):
    KILL_RESTART = "kill_restart"  # SIGKILL a role's process group, start it again on its ports
    WAN_OUTAGE = "wan_outage"  # cut the WAN both ways for duration_s
    ONE_WAY_CUT = "one_way_cut"  # cut the WAN one way (a -> b) for duration_s
    KILL_ENGINE = "kill_engine"  # SIGKILL a role's engine process; its sidecar stops; restart it
    CORRUPT = "corrupt"  # flip bits in 1% of the WAN's packets for duration_s
    BURST = "burst"  # 3 x concurrency extra requests at once (4x the usual concurrency)
    SLOW_CLIENTS = "slow_clients"  # extra HTTP streams whose clients stall or trickle (slow_clients.py)
    # pools (``harness.chaos.pools``): ``target`` names one instance of the topology
    KILL_INSTANCE = "kill_instance"  # SIGKILL one instance, start it again on its ports after duration_s
    DRAIN = "drain"  # the router's /admin/drain of one instance until its requests ended, then undrain


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    at_share: float  # fires once this share of the requests has ended
    target: str = ""  # KILL_RESTART: md | rld | p
    duration_s: float = 0.0  # outages; KILL_RESTART: how long the role stays down
    label: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.at_share < 1.0 or self.duration_s < 0:
            raise ConfigError("fault: 0 <= at_share < 1 and duration_s >= 0")
        killing = self.kind in (FaultKind.KILL_RESTART, FaultKind.KILL_ENGINE)
        if killing and self.target not in ("md", "rld", "p"):
            raise ConfigError(f"fault: {self.kind.value} needs a target md|rld|p, got {self.target!r}")
        if self.kind in (FaultKind.KILL_INSTANCE, FaultKind.DRAIN) and not self.target:
            raise ConfigError(f"fault: {self.kind.value} needs an instance name as its target")

    @property
    def name(self) -> str:
        return self.label or (f"{self.kind.value}:{self.target}" if self.target else self.kind.value)


def default_schedule(deadline_s: float) -> list[Fault]:
    """Kill -9 and restart of MD, RLD, P and MD's engine process; WAN outages shorter and longer
    than the deadline; a one-way cut; corrupted packets on the WAN; slow clients (10 extra streams
    that stop reading or trickle); a burst of 4x the concurrency."""
    return [
        Fault(FaultKind.KILL_RESTART, 0.08, "md", 2.0),
        Fault(FaultKind.WAN_OUTAGE, 0.18, duration_s=0.3 * deadline_s, label="wan_outage_short"),
        Fault(FaultKind.KILL_RESTART, 0.28, "rld", 2.0),
        Fault(FaultKind.WAN_OUTAGE, 0.38, duration_s=1.5 * deadline_s, label="wan_outage_long"),
        Fault(FaultKind.ONE_WAY_CUT, 0.50, duration_s=0.5 * deadline_s, label="one_way_cut"),
        Fault(FaultKind.KILL_RESTART, 0.60, "p", 2.0),
        Fault(FaultKind.KILL_ENGINE, 0.70, "md"),
        Fault(FaultKind.CORRUPT, 0.80, duration_s=0.5 * deadline_s, label="wan_corrupt"),
        Fault(FaultKind.SLOW_CLIENTS, 0.85, label="slow_clients"),
        Fault(FaultKind.BURST, 0.90, label="burst_4x"),
    ]
