"""What a decoder (RLD, MD) answers the router, as values: the events of an Attach stream (tokens,
MD's ``ready`` after a recompute, the one closing event) and RLD's answer to StartHandoff.

The sidecar's driver (``sidecar.decoder``, ``sidecar.relay_handoff``) makes them, the protocol
edge (``pddlink.serving.stream_pb``) maps them to and from the sidecar protocol's messages, and
the router's legs read them back; nothing in between handles protobuf or text.
"""

from __future__ import annotations

from dataclasses import dataclass

from pddlink.handoff import HandoffMode
from pddlink.lifecycle.outcomes import HandoffResult, StreamClosed


@dataclass(frozen=True, slots=True)
class DecodedToken:
    """A token of the stream at its absolute position; ``last``: the request's final token (max
    tokens or a stop token)."""

    position: int
    token_id: int
    last: bool = False


@dataclass(frozen=True, slots=True)
class PromptReady:
    """MD's recompute is done: it holds the prompt's KV (no token). ``recompute_s`` its prefill
    took, ``cached_tokens`` of the prompt its own prefix cache supplied."""

    recompute_s: float
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class StreamClosing:
    """The stream's last event: how it closed and, when handed off, the mode and slices sent."""

    closed: StreamClosed
    handoff_mode: HandoffMode | None = None
    handoff_slices: int = 0


DecoderEvent = DecodedToken | PromptReady | StreamClosing


@dataclass(frozen=True, slots=True)
class HandoffAnswer:
    """RLD's answer to StartHandoff: the result, the mode tried (``None`` when none was), the
    slices sent and the position handed over up to."""

    result: HandoffResult
    mode: HandoffMode | None = None
    slices: int = 0
    end_position: int = 0
