"""Handoff slices on the wire: ``pddlink.handoff.HandoffSlice`` <-> ``pddlink.wire.Handoff`` frames."""

from __future__ import annotations

from engines_adapter import SamplingParams
from pddlink.errors import InvalidInput
from pddlink.handoff import HandoffSlice
from pddlink.wire import Decoder, Handoff, encode


def slice_to_wire(s: HandoffSlice, sampling: SamplingParams, slice_index: int = 0) -> bytes:
    return encode(
        Handoff(
            request_id=s.request_id,
            first_position=s.first_position,
            token_ids=s.token_ids,
            seed=sampling.seed,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=sampling.stop_token_ids,
            mode=s.mode,
            slice_index=slice_index,
            final=s.final,
        )
    )


def slice_from_wire(frame: bytes) -> tuple[HandoffSlice, SamplingParams]:
    msgs = Decoder().feed(frame)
    if len(msgs) != 1 or not isinstance(msgs[0], Handoff):
        raise InvalidInput("expected exactly one Handoff frame")
    m = msgs[0]
    sampling = SamplingParams(m.seed, m.temperature, m.top_k, m.top_p, m.max_tokens, tuple(m.stop_token_ids))
    return HandoffSlice(m.request_id, m.first_position, tuple(m.token_ids), m.final, m.mode), sampling
