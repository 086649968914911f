"""A decoder's answers to and from the sidecar protocol (``pddlink.lifecycle.stream`` <->
``TokenEvent`` and ``HandoffStartReply``), with the wire version check of both directions.

Outcomes travel as enums with the reason in a field of its own. Every message a decoder sends
carries its ``WIRE_VERSION``; every request the router sends carries the router's. Either side
refuses the other version with ``WireVersionRefused`` (the sidecar's gRPC status:
``FAILED_PRECONDITION``), so an old peer is told why instead of being misread: a version 2 sidecar
sent its outcomes as text in fields this version does not read.
"""

from __future__ import annotations

from pddlink.handoff import HandoffMode
from pddlink.lifecycle.outcomes import HandoffOutcome, HandoffResult, StreamClosed, StreamEnd
from pddlink.lifecycle.stream import DecodedToken, DecoderEvent, HandoffAnswer, PromptReady, StreamClosing
from pddlink.serving.pb import pb2
from pddlink.wire.errors import VersionMismatch
from pddlink.wire.frame import WIRE_VERSION

_END_TO_PB = {
    StreamEnd.FINISHED: pb2.STREAM_END_FINISHED,
    StreamEnd.HANDED_OFF: pb2.STREAM_END_HANDED_OFF,
    StreamEnd.RELEASED: pb2.STREAM_END_RELEASED,
    StreamEnd.FAILED: pb2.STREAM_END_FAILED,
}
_END_FROM_PB = {v: k for k, v in _END_TO_PB.items()}
_OUTCOME_TO_PB = {
    HandoffOutcome.HANDED_OFF: pb2.HANDOFF_OUTCOME_HANDED_OFF,
    HandoffOutcome.FINISHED_ON_RLD: pb2.HANDOFF_OUTCOME_FINISHED_ON_RLD,
    HandoffOutcome.FAILED: pb2.HANDOFF_OUTCOME_FAILED,
    HandoffOutcome.NOT_STARTED: pb2.HANDOFF_OUTCOME_NOT_STARTED,
}
_OUTCOME_FROM_PB = {v: k for k, v in _OUTCOME_TO_PB.items()}


class WireVersionRefused(VersionMismatch):
    """A peer speaks another version of the sidecar protocol (0: one from before the version was
    sent, which is version 2)."""


def check_wire_version(got: int, who: str) -> None:
    """``WireVersionRefused`` unless ``got`` is this side's version (``who``: "router" or
    "sidecar", the side that checks)."""
    if got != WIRE_VERSION:
        seen = f"wire version {got}" if got else "no wire version (version 2 or older)"
        raise WireVersionRefused(f"{seen}; this {who} speaks {WIRE_VERSION}")


# -- sidecar -> router: the Attach stream ---------------------------------------------------------


def event_to_pb(ev: DecoderEvent) -> pb2.TokenEvent:
    if isinstance(ev, DecodedToken):
        return pb2.TokenEvent(
            position=ev.position, token_id=ev.token_id, last=ev.last, wire_version=WIRE_VERSION
        )
    if isinstance(ev, PromptReady):
        return pb2.TokenEvent(
            ready=True,
            recompute_seconds=ev.recompute_s,
            cached_tokens=ev.cached_tokens,
            wire_version=WIRE_VERSION,
        )
    return pb2.TokenEvent(
        closed=_END_TO_PB[ev.closed.end],
        reason=ev.closed.detail,
        handoff_mode=ev.handoff_mode.value if ev.handoff_mode is not None else "",
        handoff_slices=ev.handoff_slices,
        wire_version=WIRE_VERSION,
    )


def event_from_pb(ev: pb2.TokenEvent) -> DecoderEvent:
    """``WireVersionRefused`` for an event of another version (before anything in it is read)."""
    check_wire_version(ev.wire_version, "router")
    if ev.closed != pb2.STREAM_END_NONE:
        end = _END_FROM_PB.get(ev.closed)
        if end is None:  # a value a later version of this version's enum added: say so, not guess
            return StreamClosing(StreamClosed(StreamEnd.FAILED, f"unknown_stream_end:{int(ev.closed)}"))
        closed = StreamClosed(end, ev.reason)
        return StreamClosing(closed, mode_from_text(ev.handoff_mode), int(ev.handoff_slices))
    if ev.ready:
        return PromptReady(ev.recompute_seconds, int(ev.cached_tokens))
    return DecodedToken(int(ev.position), int(ev.token_id), ev.last)


# -- sidecar -> router: StartHandoff's answer -----------------------------------------------------


def answer_to_pb(a: HandoffAnswer) -> pb2.HandoffStartReply:
    return pb2.HandoffStartReply(
        result=_OUTCOME_TO_PB[a.result.outcome],
        reason=a.result.detail,
        mode=a.mode.value if a.mode is not None else "",
        slices=a.slices,
        end_position=a.end_position,
        wire_version=WIRE_VERSION,
    )


def answer_from_pb(r: pb2.HandoffStartReply) -> HandoffAnswer:
    """``WireVersionRefused`` for an answer of another version."""
    check_wire_version(r.wire_version, "router")
    outcome = _OUTCOME_FROM_PB.get(r.result)
    if outcome is None:
        result = HandoffResult(HandoffOutcome.FAILED, f"unknown_handoff_outcome:{int(r.result)}")
    else:
        result = HandoffResult(outcome, r.reason)
    return HandoffAnswer(result, mode_from_text(r.mode), int(r.slices), int(r.end_position))


def mode_from_text(text: str) -> HandoffMode | None:
    """A handoff mode's text as the mode (``None``: none, or one this side does not know)."""
    try:
        return HandoffMode(text) if text else None
    except ValueError:
        return None
