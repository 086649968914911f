"""One request at the router apart from its runs' machinery: its key (``mint_request_key``), the
checks before anything starts (``validate_request``), what ``Router.generate`` keeps of its runs
(``RequestRuns``) and each token as it is yielded (``streamed``)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from engines_adapter import SamplingParams
from pddlink.errors import InvalidInput
from pddlink.handoff import MergedToken
from pddlink.routing import OptionDecision
from router.answer import StreamedToken
from router.config import RouterConfig
from router.fleet import Route
from router.options import FORCEABLE
from router.run import RunDriver


def mint_request_key(router_name: str) -> str:
    """A key no other request of any router has: the name says whose (two routers may share one),
    the 128 random bits make it unique. No ``/``: vLLM's connector names files after it (tests)."""
    return f"{router_name}-{secrets.token_hex(16)}"


@dataclass(slots=True)
class RequestRuns:
    """One request's runs so far (``Router.generate``): ``key`` the first run's (the one it is in
    flight under), ``sid`` the current run's, its choice and route, the routes it left before its
    first token, its moves within a role and the router's stamps."""

    key: str
    sid: str
    decision: OptionDecision
    matched: int
    route: Route
    stamps: dict[str, float]
    run: RunDriver | None = None
    replaced_from: list[dict[str, str]] = field(default_factory=list)
    moved: list[dict[str, str]] = field(default_factory=list)
    stall_mark: tuple[str, float] | None = None  # its MD and that MD's StallLedger sum at its first token


def streamed(run: RunDriver, tok: MergedToken) -> StreamedToken:
    """A merged token as the router yields it, with the logprobs row its answer carried."""
    row = run.calls.run.logprobs.get((tok.source, tok.position))  # the answer's, where it carried one
    return StreamedToken(tok.position, tok.token_id, tok.source, row)


def validate_request(
    cfg: RouterConfig, prompt: list[int], sampling: SamplingParams, deadline_s: float, pipeline: str
) -> None:
    """The request's checks before anything starts (``InvalidInput``, nothing changed)."""
    if not prompt:
        raise InvalidInput("prompt must not be empty")
    if len(prompt) > cfg.max_prompt_tokens:
        raise InvalidInput(f"prompt has {len(prompt)} tokens; the limit is {cfg.max_prompt_tokens}")
    if any(not 0 <= t < cfg.vocab_size for t in prompt):
        raise InvalidInput(f"prompt token ids must be in [0, {cfg.vocab_size})")
    if sampling.max_tokens > cfg.max_tokens_limit:
        raise InvalidInput(f"max_tokens {sampling.max_tokens} exceeds the limit {cfg.max_tokens_limit}")
    if not 0 < deadline_s <= 600:
        raise InvalidInput(f"deadline_s must be in (0, 600], got {deadline_s}")
    if pipeline and pipeline not in FORCEABLE:
        raise InvalidInput(f"pipeline must be one of {', '.join(FORCEABLE)}, got {pipeline!r}")
    unsupported = sampling.vllm_only() if cfg.engine != "vllm" else ()
    if unsupported:
        raise InvalidInput(
            f'"{unsupported[0]}" is not supported by the reference engine (engine = "vllm" is)'
        )
