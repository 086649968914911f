"""The closed vocabularies of a request's life: how a stream, a handoff and a run end, and why.

Every value renders as the text the sidecar protocol and the traces have always carried
(``"failed:deadline_exceeded"``, ``"finished_on_rld"``, ``"md_lost: failed:unavailable"``), and
``parse`` reads such a text back into the enum plus its free-form detail, so the enums are used
everywhere inside and the strings only at the protocol edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum


class StreamEnd(StrEnum):
    """How a decoder's token stream (Attach) closed."""

    FINISHED = "finished"
    HANDED_OFF = "handed_off"
    RELEASED = "released"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """A stream's closing reason: ``end`` and, for ``FAILED``, what failed."""

    end: StreamEnd
    detail: str = ""

    @classmethod
    def parse(cls, text: str) -> StreamClosed:
        head, _, detail = text.partition(":")
        try:
            return cls(StreamEnd(head), detail)
        except ValueError:
            return cls(StreamEnd.FAILED, text)

    def render(self) -> str:
        return f"failed:{self.detail}" if self.end is StreamEnd.FAILED else self.end.value


class HandoffOutcome(StrEnum):
    """What RLD's StartHandoff reported (``NOT_STARTED``: RLD finished before MD was ready)."""

    HANDED_OFF = "handed_off"
    FINISHED_ON_RLD = "finished_on_rld"
    FAILED = "failed"
    NOT_STARTED = "not_started"


@dataclass(frozen=True, slots=True)
class HandoffResult:
    outcome: HandoffOutcome
    detail: str = ""

    @classmethod
    def parse(cls, text: str) -> HandoffResult:
        if text.startswith(HandoffOutcome.FINISHED_ON_RLD.value):
            return cls(HandoffOutcome.FINISHED_ON_RLD, text[len(HandoffOutcome.FINISHED_ON_RLD) :])
        if text in (HandoffOutcome.HANDED_OFF.value, HandoffOutcome.NOT_STARTED.value):
            return cls(HandoffOutcome(text))
        return cls(HandoffOutcome.FAILED, text.removeprefix("failed:"))

    def render(self) -> str:
        if self.outcome is HandoffOutcome.FAILED:
            return f"failed:{self.detail}"
        return self.outcome.value + self.detail


class RunOutcome(StrEnum):
    FINISHED = "finished"
    FAILED = "failed"


class FailReason(StrEnum):
    """Why a request failed at the router (rendered ``"<reason>: <detail>"`` when there is one)."""

    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    P_UNAVAILABLE = "p_unavailable"
    MD_UNREACHABLE = "md_unreachable"
    MD_CONGESTED = "wan_congested"
    RLD_UNREACHABLE = "rld_unreachable"
    RLD_LOST = "rld_lost"
    MD_LOST = "md_lost"
    MD_STALLED = "md_stalled"
    LEG_CRASHED = "leg_crashed"  # a call of the run raised unexpectedly (``LegCrashed``)


class Fallback(StrEnum):
    """A fallback the router took (counted in ``pddlink_fallbacks_total{kind}``, listed in traces)."""

    MD_UNREACHABLE_RLD_FINISHES = "md_unreachable_rld_finishes"
    MD_UNREACHABLE_P_RLD = "md_unreachable_p_rld"
    MD_CONGESTED_RLD_FINISHES = "wan_congested_rld_finishes"
    MD_CONGESTED_P_RLD = "wan_congested_p_rld"
    RLD_UNREACHABLE_MD_TAKES_OVER = "rld_unreachable_md_takes_over"
    RLD_LOST_MD_TAKES_OVER = "rld_lost_md_takes_over"
    RLD_LOST_P_MD = "rld_lost_p_md"
    MD_LOST_RLD_FINISHES = "md_lost_rld_finishes"
    MD_LOST_P_RLD = "md_lost_p_rld"
    MD_STALLED_RLD_FINISHES = "md_stalled_rld_finishes"
    MD_STALLED_P_RLD = "md_stalled_p_rld"
    HANDOFF_FAILED_RLD_FINISHES = "handoff_failed_rld_finishes"
    # re-placed within the role (pools): a new leg on another instance of the role that was lost
    MD_LOST_OTHER_MD = "md_lost_other_md"
    MD_UNREACHABLE_OTHER_MD = "md_unreachable_other_md"
    MD_STALLED_OTHER_MD = "md_stalled_other_md"
    P_LOST_OTHER_P = "p_lost_other_p"


class Loss(Enum):
    """What went wrong, as the fallback table sees it."""

    MD_UNREACHABLE = "md_unreachable"  # P's reply: the WAN shipment to MD failed
    MD_CONGESTED = "wan_congested"  # P's reply: the WAN shipment lost to its deadline (a full line)
    RLD_UNREACHABLE = "rld_unreachable"  # P's reply: the fast-path shipment failed, or RLD's stream is gone
    RLD_LOST = "rld_lost"  # RLD's stream broke before the request finished
    MD_LOST = "md_lost"  # MD's stream broke, or the router's takeover handoff to MD failed
    MD_STALLED = "md_stalled"  # MD's stream is open but made no progress for the stall bound
    P_LOST = "p_unavailable"  # P's Prefill failed before it replied (P killed, unreachable)
