"""The ``outage`` rule shared by the netns/loopback lab and the compose lab (own module, so that
neither lab's commands import the other's)."""

from __future__ import annotations

from typing import Protocol

from pddlink.errors import InvalidInput


class OutageLab(Protocol):
    """What both lab kinds offer for a WAN cut."""

    def outage(self, seconds: float, direction: str) -> None: ...

    def set_outage(self, on: bool, direction: str) -> None: ...


def apply_outage(lab: OutageLab, seconds: float | None, switch: bool | None, direction: str) -> None:
    """``outage`` of either lab kind: a timed cut (--seconds) or a switch (--on/--off), not both."""
    if seconds is not None and switch is None:
        lab.outage(seconds, direction)
    elif seconds is None and switch is not None:
        lab.set_outage(switch, direction)
    else:
        raise InvalidInput("give exactly one of --seconds S, --on, --off")
