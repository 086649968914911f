"""Noticing an MD that stops producing tokens without closing its stream (a stopped engine, a WAN
that black-holes the stream): sans-I/O, time passed in.

A run's ``StallWatch`` is armed while MD *owes* the request progress: P's reply said MD holds the
KV (ship), MD's ready event came (recompute), RLD handed the request over, or the router handed it
to MD itself. Every token from MD (and the ready event) re-arms it; MD's stream ending, a new leg
or the end of the run disarms it. No progress for ``bound_s`` is a stall: the run takes the
``Loss.MD_STALLED`` row of the fallback table (RLD finishes, or a new leg on RLD while P still holds
the KV; else it fails ``md_stalled``) and tells the router, which keeps new requests off MD.

The bound (``md_stall_bound``) comes from the link estimate and MD's time per token: a token
crosses the WAN in an RTT, and MD's batch emits one every ``tpot_s``; ``STALL_RTTS`` RTTs and
``STALL_TOKENS`` token times without a token is far outside what a live MD does, and
``MD_STALL_MIN_S`` keeps scheduling hiccups (a loaded host, a garbage collection) from counting.
"""

from __future__ import annotations

from dataclasses import dataclass

MD_STALL_MIN_S = 2.0
SUSPECT_S = 0.5  # a run's MD silence that counts as a stall once another run saw MD stall
STALL_RTTS = 8
STALL_TOKENS = 32


def md_stall_bound(rtt_s: float, tpot_s: float, floor_s: float = MD_STALL_MIN_S) -> float:
    """Seconds without progress from MD that count as a stall."""
    return max(floor_s, STALL_RTTS * max(rtt_s, 0.0) + STALL_TOKENS * max(tpot_s, 0.0))


@dataclass(slots=True)
class StallWatch:
    bound_s: float
    since: float | None = None  # last progress while armed (None: MD owes nothing now)
    suspect: bool = False  # another run saw MD stall: a short silence is enough (``SUSPECT_S``)

    def arm(self, now: float) -> None:
        """MD owes progress from ``now``, or just made some (a token: it streams, so it owes more;
        and it is alive: a suspicion ends)."""
        self.since = now
        self.suspect = False

    def suspected(self, now: float) -> None:
        """MD stalled for another run: this run's silence since ``now`` or earlier counts after
        ``SUSPECT_S`` (a silent stream stalls at once when it has been silent that long)."""
        self.suspect = True

    def disarm(self) -> None:
        self.since = None

    def due(self) -> float | None:
        """When MD counts as stalled unless it makes progress first."""
        if self.since is None:
            return None
        return self.since + (min(self.bound_s, SUSPECT_S) if self.suspect else self.bound_s)

    def stalled(self, now: float) -> bool:
        due = self.due()
        return due is not None and now >= due


COOL_DOWN_S = 2.0  # after a stall, new requests the router places keep off MD this long
COOL_DOWN_MAX_S = 30.0


@dataclass(slots=True)
class StallBreaker:
    """The router's memory of MD's stalls (a circuit breaker): after a stall new requests keep off
    MD for ``cool_s``; a stall again soon after the cool-down (MD still stopped) doubles it, up to
    ``COOL_DOWN_MAX_S``; a request that got tokens from MD without a stall shows it is healthy
    again: new requests may use MD at once, and the next stall starts from the base cool-down."""

    cool_s: float = COOL_DOWN_S
    down_until: float = 0.0
    stalls: int = 0

    def stalled(self, now: float) -> None:
        if self.stalls and now < self.down_until + self.cool_s:
            self.cool_s = min(2 * self.cool_s, COOL_DOWN_MAX_S)  # not back yet
        self.stalls += 1
        self.down_until = max(self.down_until, now + self.cool_s)

    def healthy(self) -> None:
        self.cool_s, self.down_until = COOL_DOWN_S, 0.0

    def usable(self, now: float) -> bool:
        return now >= self.down_until
