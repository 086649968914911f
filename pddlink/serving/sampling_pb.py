"""Sampling parameters to and from the sidecar protocol's ``Sampling`` message (router and service)."""

from __future__ import annotations

from engines_adapter import SamplingParams
from pddlink.serving.pb import pb2


def sampling_from_pb(s: pb2.Sampling) -> SamplingParams:
    return SamplingParams(
        seed=int(s.seed),
        temperature=float(s.temperature),
        top_k=int(s.top_k),
        top_p=float(s.top_p) if s.top_p else 1.0,
        max_tokens=int(s.max_tokens) or 16,
        stop_token_ids=tuple(int(t) for t in s.stop_token_ids),
    )


def sampling_to_pb(s: SamplingParams) -> pb2.Sampling:
    return pb2.Sampling(
        seed=s.seed,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        stop_token_ids=list(s.stop_token_ids),
    )
