"""Conversation traces: every turn re-sends the conversation so far (its previous prompt, the answer
and a new question), sessions share system prompts, and the trace format carries it as it stands."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pddlink.errors import ConfigError
from pddlink.sim.conversation import ConversationConfig, conversation_trace
from pddlink.sim.trace import read_trace, write_trace
from pddlink.sim.workload import load_workload

CFG = ConversationConfig(rate_rps=2.0, requests=300, seed=3)


@pytest.fixture(scope="module")
def trace():  # type: ignore[no-untyped-def]
    return conversation_trace(load_workload(), CFG)


def test_each_turn_starts_with_the_previous_turn_and_grows_by_its_answer(trace) -> None:  # type: ignore[no-untyped-def]
    last = {}
    grew = 0
    for r in trace.requests:
        before = last.get(r.session_id)
        if before is not None:
            assert r.block_ids[: len(before.block_ids)] == before.block_ids
            answer_blocks = -(-before.output_tokens // CFG.block_tokens)
            assert len(r.block_ids) >= len(before.block_ids) + answer_blocks + 1
            assert r.arrival_s >= before.arrival_s + CFG.turn_gap_s[0]
            grew += 1
        last[r.session_id] = r
    assert grew > len(trace.requests) // 2  # most requests are later turns


def test_sessions_open_with_shared_system_prompts(trace) -> None:  # type: ignore[no-untyped-def]
    firsts = {}
    for r in trace.requests:
        firsts.setdefault(r.session_id, r)
    heads = [r.block_ids[0] for r in firsts.values()]
    assert len(set(heads)) <= CFG.templates < len(heads)


def test_whole_blocks_arrival_order_count_and_no_singular_bounds(trace) -> None:  # type: ignore[no-untyped-def]
    rs = trace.requests
    assert len(rs) == CFG.requests
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(rs))
    assert all(r.prompt_tokens == len(r.block_ids) * CFG.block_tokens for r in rs)
    assert all(r.prompt_tokens <= CFG.max_context_tokens for r in rs)
    assert all(r.max_tokens > 16 for r in rs)


def test_deterministic_for_a_seed_and_different_across_seeds() -> None:
    w = load_workload()
    small = ConversationConfig(rate_rps=2.0, requests=40, seed=5)
    assert conversation_trace(w, small) == conversation_trace(w, small)
    other = conversation_trace(w, ConversationConfig(rate_rps=2.0, requests=40, seed=6))
    assert other.requests != conversation_trace(w, small).requests


def test_round_trips_through_the_trace_format(trace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    write_trace(tmp_path / "c.jsonl", trace)
    assert read_trace(tmp_path / "c.jsonl").requests == trace.requests


def test_bad_config_is_refused() -> None:
    with pytest.raises(ConfigError):
        ConversationConfig(rate_rps=1.0, requests=10, turns=(0, 3))
    with pytest.raises(ConfigError):
        ConversationConfig(rate_rps=1.0, requests=10, question_tokens=(9, 3))
