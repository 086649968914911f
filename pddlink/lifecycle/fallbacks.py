"""The router's fallback table: for each kind of loss, the first row whose guard holds says what to do.

A guard reads a ``Situation``, the run's state at the moment of the loss. The recoveries:

- ``RLD_FINISHES``: RLD keeps streaming and finishes the request (MD's part is dropped);
- ``MD_TAKES_OVER``: the router hands the tokens streamed so far to MD (one-shot, final);
- ``WAIT_FOR_P``: RLD is gone but P's reply (does MD hold the KV?) is not in yet: mark RLD as not
  reached; the reply then takes the ``RLD_UNREACHABLE`` row;
- ``NEW_LEG_P_RLD`` / ``NEW_LEG_P_MD``: a new leg from the merged position on (P re-prefills prompt +
  streamed tokens; its prefix cache makes that cheap; sampling is a function of (seed, position), so
  the continuation is the same), at most ``MAX_LEGS`` legs per request;
- ``NEW_LEG_OTHER_MD`` / ``NEW_LEG_OTHER_P`` (pools): the lost instance's role has another
  instance in placement (``Situation.md_spare`` / ``p_spare``): the router re-places the run within
  the role (``MoveOff``) and a new leg runs there from the merged position on -- P->MD on the other
  MD (RLD's stream, if any, is released: the request ends on an MD, as a normal one does); the
  same pipeline on the other P (the current leg's decoders are released, they wait for KV the dead
  P will not send). These rows come first: a request is re-placed within its role before it
  changes pipeline, and a normal request ends on an MD. A stall of the WAN line silences every MD
  behind it too: a run that stalls again there moves on (never back to an MD it lost), bounded by
  ``MAX_LEGS`` and its deadline. With one instance of each role they never match (no spare), so
  the single-instance router behaves as before;
- ``FAIL``: the request fails with the loss as its reason.

``RLD_LOST`` re-runs P->MD only while RLD is *not* usable (relay disabled, or marked down after a
recent loss): a usable RLD whose stream broke mid-request fails the request rather than retrying it
(the behaviour the sidecar router has had; kept as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from pddlink.lifecycle.outcomes import Fallback, Loss
from pddlink.routing import Pipeline

MAX_LEGS = 4  # the first leg and up to three fallback legs


class Recovery(Enum):
    RLD_FINISHES = "rld_finishes"
    MD_TAKES_OVER = "md_takes_over"
    WAIT_FOR_P = "wait_for_p"
    NEW_LEG_P_RLD = "new_leg_p_rld"
    NEW_LEG_P_MD = "new_leg_p_md"
    NEW_LEG_OTHER_MD = "new_leg_other_md"
    NEW_LEG_OTHER_P = "new_leg_other_p"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Situation:
    pipeline: Pipeline  # the current leg's
    md_ok: bool | None  # P's reply: MD holds the KV (None: no reply yet)
    rld_ok: bool | None
    md_alive: bool  # MD's stream is open
    rld_alive: bool
    rld_handed_off: bool  # RLD reported the handoff done
    rld_usable: bool  # the router may send requests to RLD now
    rld_reachable: bool  # RLD can take a rescue (its channel is up), cool-down or not
    legs: int  # legs started so far
    md_spare: bool = False  # another MD than this run's is in placement (pools)
    p_spare: bool = False  # another P than this run's is in placement (pools)

    @property
    def may_add_leg(self) -> bool:
        return self.legs < MAX_LEGS


Guard = Callable[[Situation], bool]
Row = tuple[Guard, Fallback | None, Recovery]


def always(_: Situation) -> bool:
    return True


def relayed_rld_has_kv(s: Situation) -> bool:
    return s.pipeline is Pipeline.P_RLD_MD and bool(s.rld_ok)


def relayed(s: Situation) -> bool:
    return s.pipeline is Pipeline.P_RLD_MD


def rerun_on_rld(s: Situation) -> bool:
    """MD is lost: RLD is the only decoder left, so a cool-down of RLD does not stop the rescue."""
    return s.rld_reachable and s.may_add_leg


def rerun_on_md(s: Situation) -> bool:
    return not s.rld_usable and s.may_add_leg


def other_md(s: Situation) -> bool:
    return s.md_spare and s.may_add_leg


def other_p(s: Situation) -> bool:
    return s.p_spare and s.may_add_leg


def md_holds_kv(s: Situation) -> bool:
    return s.md_alive and s.md_ok is True


def md_reply_pending(s: Situation) -> bool:
    return s.md_alive and s.md_ok is None


def rld_streaming(s: Situation) -> bool:
    return s.rld_alive and not s.rld_handed_off


# fmt: off
TABLE: dict[Loss, tuple[Row, ...]] = {
    Loss.MD_UNREACHABLE: (
        (other_md,           Fallback.MD_UNREACHABLE_OTHER_MD,       Recovery.NEW_LEG_OTHER_MD),
        (relayed_rld_has_kv, Fallback.MD_UNREACHABLE_RLD_FINISHES,   Recovery.RLD_FINISHES),
        (rerun_on_rld,       Fallback.MD_UNREACHABLE_P_RLD,          Recovery.NEW_LEG_P_RLD),
        (always,             None,                                   Recovery.FAIL),
    ),
    Loss.MD_CONGESTED: (
        (relayed_rld_has_kv, Fallback.MD_CONGESTED_RLD_FINISHES,     Recovery.RLD_FINISHES),
        (rerun_on_rld,       Fallback.MD_CONGESTED_P_RLD,            Recovery.NEW_LEG_P_RLD),
        (always,             None,                                   Recovery.FAIL),
    ),
    Loss.RLD_UNREACHABLE: (
        (relayed,            Fallback.RLD_UNREACHABLE_MD_TAKES_OVER, Recovery.MD_TAKES_OVER),
        (always,             None,                                   Recovery.FAIL),
    ),
    Loss.RLD_LOST: (
        (md_holds_kv,        Fallback.RLD_LOST_MD_TAKES_OVER,        Recovery.MD_TAKES_OVER),
        (md_reply_pending,   None,                                   Recovery.WAIT_FOR_P),
        (rerun_on_md,        Fallback.RLD_LOST_P_MD,                 Recovery.NEW_LEG_P_MD),
        (always,             None,                                   Recovery.FAIL),
    ),
    Loss.MD_LOST: (
        (other_md,           Fallback.MD_LOST_OTHER_MD,              Recovery.NEW_LEG_OTHER_MD),
        (rld_streaming,      Fallback.MD_LOST_RLD_FINISHES,          Recovery.RLD_FINISHES),
        (rerun_on_rld,       Fallback.MD_LOST_P_RLD,                 Recovery.NEW_LEG_P_RLD),
        (always,             None,                                   Recovery.FAIL),
    ),
    Loss.MD_STALLED: (
        (other_md,           Fallback.MD_STALLED_OTHER_MD,           Recovery.NEW_LEG_OTHER_MD),
        (rld_streaming,      Fallback.MD_STALLED_RLD_FINISHES,       Recovery.RLD_FINISHES),
        (rerun_on_rld,       Fallback.MD_STALLED_P_RLD,              Recovery.NEW_LEG_P_RLD),
        (always,             None,                                   Recovery.FAIL),
    ),
    Loss.P_LOST: (
        (other_p,            Fallback.P_LOST_OTHER_P,                Recovery.NEW_LEG_OTHER_P),
        (always,             None,                                   Recovery.FAIL),
    ),
}
# fmt: on


def choose(loss: Loss, situation: Situation) -> tuple[Fallback | None, Recovery]:
    """The first row of ``loss`` whose guard holds (every table ends with an unconditional row)."""
    for guard, fallback, recovery in TABLE[loss]:
        if guard(situation):
            return fallback, recovery
    raise AssertionError(f"fallback table for {loss} has no final row")  # pragma: no cover
