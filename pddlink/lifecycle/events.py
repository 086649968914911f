"""What goes into a router run (events: what the sidecars answered) and what comes out (commands:
RPCs to make, streams to cancel, tokens to send). All frozen values; the driver maps them to gRPC.

Every event names the leg (``sid``, the sub-request id on the sidecars) it belongs to: tokens of any
leg count (they carry absolute positions), everything else from a superseded leg is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from pddlink.handoff import HandoffMode, MergedToken
from pddlink.lifecycle.outcomes import Fallback, HandoffResult, RunOutcome, StreamClosed
from pddlink.roles import Role
from pddlink.routing import Pipeline, RecomputeMode
from pddlink.sampling import SamplingParams

# -- events in ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """P's Prefill reply: the first token, which shipments reached their decoder, and its figures."""

    first_token: int
    md_ok: bool
    rld_ok: bool
    wan_bytes: int = 0
    fast_bytes: int = 0
    wan_seconds: float = 0.0
    fast_seconds: float = 0.0
    wan_rtt_s: float = 0.0
    wan_retransmits: int = 0
    compression_ratio: float = 1.0
    md_cached_tokens: int = 0
    p_cached_tokens: int = 0
    fast_path: str = ""
    prefill_seconds: float = 0.0
    md_error: str = ""
    rld_error: str = ""


@dataclass(frozen=True, slots=True)
class TokenArrived:
    sid: str
    source: Role
    position: int
    token_id: int
    last: bool = False


@dataclass(frozen=True, slots=True)
class StreamEnded:
    sid: str
    source: Role
    closed: StreamClosed
    handoff_mode: HandoffMode | None = None


@dataclass(frozen=True, slots=True)
class PrefillDone:
    sid: str
    report: PrefillReport


@dataclass(frozen=True, slots=True)
class PrefillFailed:
    sid: str
    detail: str


@dataclass(frozen=True, slots=True)
class HandoffDone:
    """RLD's StartHandoff answered (or its RPC failed: ``FAILED`` with the status)."""

    sid: str
    result: HandoffResult
    mode: HandoffMode | None = None


@dataclass(frozen=True, slots=True)
class TakeoverFailed:
    """The router's own Handoff to MD (RLD lost) failed."""

    sid: str
    detail: str


@dataclass(frozen=True, slots=True)
class MdReady:
    """MD's recompute is done (its Attach stream's ``ready`` event): it holds the prompt's KV;
    ``recompute_s`` its prefill took, ``cached_tokens`` of the prompt its own cache supplied."""

    sid: str
    recompute_s: float
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class MdSuspected:
    """Another run saw MD stall (a WAN outage silences every stream at once): this run's MD
    stream, if silent, counts as stalled after the short ``stall.SUSPECT_S`` instead of the full
    bound, until MD's next token shows it alive. Not tied to a leg."""

    sid: str = ""


@dataclass(frozen=True, slots=True)
class LegCrashed:
    """One of the leg's calls raised what its driver does not expect (a bug, an answer it cannot
    read): nothing more will come of that call, so the run fails at once (``leg_crashed``) instead
    of waiting for its deadline. ``task``: the driver's name for the call ("md1", "p1", "handoff");
    ``error``: the exception, ``"<type>: <message>"`` (``of``)."""

    sid: str
    task: str
    error: str

    @classmethod
    def of(cls, sid: str, task: str, exc: BaseException) -> LegCrashed:
        text = str(exc)
        return cls(sid, task, f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__)


RunEvent = (
    TokenArrived
    | StreamEnded
    | PrefillDone
    | PrefillFailed
    | HandoffDone
    | TakeoverFailed
    | MdReady
    | MdSuspected
    | LegCrashed
)

# -- commands out ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Leg:
    """One sub-request on the sidecars: the prompt plus the tokens already streamed, and the
    sampling of what is left."""

    sid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    pipeline: Pipeline
    recompute: RecomputeMode = RecomputeMode.NONE  # MD prefills the prompt itself (first leg only)


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Attach on ``on`` (RLD or MD): its token events and how it closed come back as events.
    Opening one on RLD takes one of RLD's slots (``ReleaseRldSlot`` gives it back)."""

    on: Role
    leg: Leg


@dataclass(frozen=True, slots=True)
class SendPrefill:
    leg: Leg
    ship_to_md: bool
    ship_to_rld: bool
    first_token_to_md: bool


@dataclass(frozen=True, slots=True)
class StartHandoff:
    """Ask RLD to hand ``sid`` over to MD (answer: ``HandoffDone``)."""

    sid: str


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The router hands the request to MD itself (RLD lost): ``token_ids`` from ``first_position``
    on, one-shot and final; ``emit_given``: MD streams those ids too (none were sent yet)."""

    leg: Leg
    first_position: int
    token_ids: tuple[int, ...]
    emit_given: bool


@dataclass(frozen=True, slots=True)
class CancelStreams:
    """Cancel every stream open on ``on`` (each is released there)."""

    on: Role


@dataclass(frozen=True, slots=True)
class ReleaseRldSlot:
    pass


@dataclass(frozen=True, slots=True)
class DetachHandoff:
    """Stop tracking RLD's StartHandoff call: RLD finishes the request, the call ends by itself."""


@dataclass(frozen=True, slots=True)
class MdStalled:
    """MD's stream made no progress for the stall bound (its stream is cancelled, a fallback
    follows): the router keeps new requests off MD for a while."""

    seconds: float  # how long MD had been silent


@dataclass(frozen=True, slots=True)
class MoveOff:
    """The instance of ``role`` this run uses is lost: the router re-places the run within the
    role (another instance, never the lost one) before the next leg's commands; the legs that
    follow go there. Issued only while ``RequestRun``'s ``spare(role, now)`` said one is there."""

    role: Role


@dataclass(frozen=True, slots=True)
class FallbackTaken:
    fallback: Fallback


@dataclass(frozen=True, slots=True)
class Emit:
    token: MergedToken


@dataclass(frozen=True, slots=True)
class RunEnded:
    """The request is over (the trace is final); the driver tears the legs down."""

    outcome: RunOutcome


RunCommand = (
    OpenStream
    | SendPrefill
    | StartHandoff
    | TakeOver
    | CancelStreams
    | ReleaseRldSlot
    | DetachHandoff
    | MdStalled
    | MoveOff
    | FallbackTaken
    | Emit
    | RunEnded
)
