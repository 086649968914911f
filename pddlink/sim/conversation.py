"""Conversation traffic: chat sessions whose every turn re-sends the whole conversation so far.

A session opens with one of a few shared system prompts (Zipf-like popularity), then asks its first
question. Each later turn's prompt is the previous turn's prompt, followed by the answer to it (as
many tokens as that turn's output) and the next question: prompts grow by the previous turns, so a
turn's prefix is exactly its previous turn's prompt, and its hit on a decode-side cache is whatever
that cache kept of the session (the system prompt only for a first turn). Turns of a session are a
think time apart after the previous answer is out (``turn_gap_s`` plus the answer at ``tpot_s``);
sessions open as a Poisson process whose rate gives about ``rate_rps`` requests per second.

The trace is written whole-block (every prompt a whole number of ``block_tokens`` blocks) so the
shared prefix of two turns is a shared run of block ids, as the trace format requires; output
lengths follow the workload's output CDF. Pure and deterministic for a seed.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from pddlink.errors import ConfigError
from pddlink.sim.trace import Trace, TraceMeta, TraceRequest
from pddlink.sim.workload import Workload

MAX_TOKENS = 4096  # every turn's output bound (the API's usual default): no turn is singular


@dataclass(frozen=True, slots=True)
class ConversationConfig:
    rate_rps: float
    requests: int
    seed: int = 0
    block_tokens: int = 128
    system_tokens: tuple[int, int] = (1024, 3072)  # a system prompt's length, drawn per template
    templates: int = 8
    question_tokens: tuple[int, int] = (128, 768)
    turns: tuple[int, int] = (2, 8)  # turns per session, uniform
    turn_gap_s: tuple[float, float] = (10.0, 40.0)  # the user's think time after an answer
    tpot_s: float = 0.03  # how fast an answer streams, for the next turn's arrival
    max_context_tokens: int = 32768  # a session that would grow past this ends

    def __post_init__(self) -> None:
        if self.rate_rps <= 0 or self.requests < 1 or self.block_tokens < 1 or self.templates < 1:
            raise ConfigError("rate_rps, requests, block_tokens and templates must be > 0")
        for name in ("system_tokens", "question_tokens", "turns", "turn_gap_s"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ConfigError(f"{name} must be 0 <= lo <= hi, got {(lo, hi)}")
        if self.turns[0] < 1 or self.max_context_tokens < self.block_tokens:
            raise ConfigError("a session needs at least one turn and room for one block")


@dataclass(slots=True)
class _Session:
    session_id: int
    blocks: list[int]
    turns_left: int


class _Builder:
    def __init__(self, workload: Workload, cfg: ConversationConfig) -> None:
        self.cfg, self.workload = cfg, workload
        self.rng = random.Random(cfg.seed)
        self.next_block = 0
        self.systems = [self.fresh(self.tokens(cfg.system_tokens)) for _ in range(cfg.templates)]
        weights = [1.0 / (i + 1) for i in range(cfg.templates)]
        self.system_weights = [w / sum(weights) for w in weights]

    def tokens(self, span: tuple[int, int]) -> int:
        return self.rng.randint(*span)

    def fresh(self, tokens: int) -> list[int]:
        n = max(1, math.ceil(tokens / self.cfg.block_tokens))
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def output_tokens(self) -> int:
        cdf = self.workload.output_cdf
        u = self.rng.random()
        prev_t, prev_c = 1, 0.0
        for point in cdf:
            if u <= point.cdf:
                frac = (u - prev_c) / max(1e-12, point.cdf - prev_c)
                return max(1, round(prev_t + frac * (point.tokens - prev_t)))
            prev_t, prev_c = point.tokens, point.cdf
        return prev_t

    def open(self, session_id: int) -> _Session:
        system = self.rng.choices(self.systems, self.system_weights)[0]
        turns = self.rng.randint(*self.cfg.turns)
        return _Session(session_id, [*system, *self.fresh(self.tokens(self.cfg.question_tokens))], turns)


def conversation_trace(workload: Workload, cfg: ConversationConfig) -> Trace:
    """``cfg.requests`` turns of chat sessions, in arrival order (see the module docstring)."""
    b = _Builder(workload, cfg)
    mean_turns = sum(cfg.turns) / 2
    session_rate = cfg.rate_rps / mean_turns
    due: list[tuple[float, int, _Session]] = []  # (arrival_s, session id, session)
    t_open, opened = 0.0, 0
    out: list[TraceRequest] = []
    while len(out) < cfg.requests:
        if not due or t_open <= due[0][0]:
            heapq.heappush(due, (t_open, opened, b.open(opened)))
            opened += 1
            t_open += b.rng.expovariate(session_rate)
            continue
        now, sid, session = heapq.heappop(due)
        n = b.output_tokens()
        tokens = len(session.blocks) * cfg.block_tokens
        arrival = round(now, 6)  # as the trace format writes it
        out.append(TraceRequest(len(out), arrival, sid, tuple(session.blocks), tokens, n, max(n, MAX_TOKENS)))
        session.turns_left -= 1
        answer_and_question = b.fresh(n) + b.fresh(b.tokens(cfg.question_tokens))
        grown = len(session.blocks) + len(answer_and_question)
        if session.turns_left > 0 and grown * cfg.block_tokens <= cfg.max_context_tokens:
            session.blocks.extend(answer_and_question)
            gap = b.rng.uniform(*cfg.turn_gap_s) + n * cfg.tpot_s
            heapq.heappush(due, (now + gap, sid, session))
    source = f"conversation {workload.name} rate={cfg.rate_rps} seed={cfg.seed}"
    return Trace(TraceMeta(cfg.block_tokens, source), tuple(out))
