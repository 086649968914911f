"""Bad input gets a typed error and changes nothing, on both adapters.

Each case builds a little state (live requests, cached prefixes), takes a digest of every piece of
bookkeeping plus the exported KV bytes of every live request, feeds one bad call, and checks the
error type and that the digest is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from _engine_testkit import BLOCK, hf_engine, torch_engine

from engines_adapter.base import (
    EngineError,
    InvalidBlocks,
    InvalidRequest,
    InvalidTokens,
    KVBlocks,
    LayoutMismatch,
    PoolExhausted,
    SamplingParams,
    UnknownRequest,
)
from engines_adapter.torch_ref.paged_engine import PagedEngine
from pddlink.errors import InvalidInput

SP = SamplingParams(max_tokens=8)
PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks and a partial one


@pytest.fixture(params=["torch_ref", "hf"])
def engine(request: pytest.FixtureRequest) -> PagedEngine:
    if request.param == "hf":
        pytest.importorskip("transformers")
        eng = hf_engine(num_blocks=64)
    else:
        eng = torch_engine(num_blocks=64)
    assert isinstance(eng, PagedEngine)
    eng.prefill("src", PROMPT, SP)  # KV of exactly the prompt (its first token pending)
    eng.prefill("live", [*PROMPT, 2], SP)  # a decoded request
    eng.decode(["live"])
    eng.prefill("cached", [*PROMPT[:8], 1, 2], SP)
    eng.release("cached")  # leaves 2 full blocks in the prefix cache
    eng.prefill("gone", [3, 4, 5], SP)
    eng.release("gone")
    eng.import_kv("imported", PROMPT, [exported_prompt(eng)], SP)  # no pending token
    return eng


def exported_prompt(eng: PagedEngine) -> KVBlocks:
    kb = eng.export_kv("src")
    assert kb.num_tokens == len(PROMPT)
    return kb


def digest(eng: PagedEngine) -> tuple[object, ...]:
    kv = tuple(bytes(eng.export_kv(r).data) for r in eng.live_requests)
    return eng.state_digest(), kv, tuple(tuple(eng.tokens(r)) for r in eng.live_requests)


def assert_refused(eng: PagedEngine, call: Callable[[], object], error: type[EngineError]) -> None:
    before = digest(eng)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, EngineError)
    assert info.value.message  # a clear message, not an empty one
    assert digest(eng) == before


def test_unknown_and_released_requests(engine: PagedEngine) -> None:
    for rid in ("never", "gone"):
        assert_refused(engine, lambda r=rid: engine.extend(r, [1]), UnknownRequest)
        assert_refused(engine, lambda r=rid: engine.decode(["live", r]), UnknownRequest)
        assert_refused(engine, lambda r=rid: engine.export_kv(r), UnknownRequest)
        assert_refused(engine, lambda r=rid: engine.release(r), UnknownRequest)
        assert_refused(engine, lambda r=rid: engine.tokens(r), UnknownRequest)
    with pytest.raises(UnknownRequest, match="released"):
        engine.extend("gone", [1])


def test_extend_on_a_request_released_mid_flight(engine: PagedEngine) -> None:
    pending = engine.tokens("live")[-1]
    engine.release("live")
    assert_refused(engine, lambda: engine.extend("live", [pending, 5]), UnknownRequest)


def test_tokens_out_of_vocabulary(engine: PagedEngine) -> None:
    v = engine.vocab_size
    assert_refused(engine, lambda: engine.prefill("new", [1, v], SP), InvalidTokens)
    assert_refused(engine, lambda: engine.prefill("new", [-1, 2], SP), InvalidTokens)
    assert_refused(engine, lambda: engine.prefill("new", [], SP), InvalidTokens)
    assert_refused(engine, lambda: engine.extend("imported", [5, v + 7]), InvalidTokens)
    assert_refused(engine, lambda: engine.import_kv("new", [v], [], SP), InvalidTokens)
    assert_refused(engine, lambda: engine.cached_prefix_tokens([0, v]), InvalidTokens)
    assert_refused(engine, lambda: engine.prefill("new", [1] * engine.max_positions, SP), InvalidTokens)


def test_extend_must_continue_the_sequence(engine: PagedEngine) -> None:
    pending = engine.tokens("live")[-1]
    wrong = (pending + 1) % engine.vocab_size
    assert_refused(engine, lambda: engine.extend("live", [wrong, 3]), InvalidTokens)
    assert_refused(engine, lambda: engine.extend("live", []), InvalidTokens)
    too_many = [pending] + [7] * SP.max_tokens  # would pass max_tokens
    assert_refused(engine, lambda: engine.extend("live", too_many), InvalidTokens)


def test_stop_token_inside_extend_is_refused() -> None:
    eng = torch_engine(num_blocks=32)
    eng.prefill("r", PROMPT, replace(SP, stop_token_ids=(9,)))
    pending = eng.tokens("r")[-1]
    assert_refused(eng, lambda: eng.extend("r", [pending, 9, 4]), InvalidTokens)


def test_requests_in_the_wrong_state(engine: PagedEngine) -> None:
    assert_refused(engine, lambda: engine.prefill("live", PROMPT, SP), InvalidRequest)
    assert_refused(engine, lambda: engine.import_kv("live", PROMPT, [], SP), InvalidRequest)
    assert_refused(engine, lambda: engine.decode(["live", "live"]), InvalidRequest)
    assert_refused(
        engine, lambda: engine.decode(["live", "imported"]), InvalidRequest
    )  # imported: extend first
    assert_refused(engine, lambda: engine.prefill("", PROMPT, SP), InvalidRequest)


def test_finished_request_cannot_continue(engine: PagedEngine) -> None:
    engine.prefill("short", [1, 2, 3], SamplingParams(max_tokens=1))
    assert engine.is_finished("short")
    assert_refused(engine, lambda: engine.decode(["short"]), InvalidRequest)
    assert_refused(engine, lambda: engine.extend("short", engine.tokens("short")[-1:]), InvalidRequest)


def test_block_ranges_out_of_bounds(engine: PagedEngine) -> None:
    n = -(-len(engine.tokens("live")) // BLOCK)
    for first, count in ((n, 1), (-1, 1), (0, n + 1), (2, -1), (10**6, None)):
        assert_refused(engine, lambda f=first, c=count: engine.export_kv("live", f, c), InvalidBlocks)


def test_import_with_bad_blocks(engine: PagedEngine) -> None:
    kb = exported_prompt(engine)
    tail = engine.export_kv("src", 1, kb.num_blocks - 1)
    head = engine.export_kv("src", 0, 2)
    assert_refused(
        engine, lambda: engine.import_kv("new", PROMPT, [tail], SP), InvalidBlocks
    )  # gap at block 0
    assert_refused(engine, lambda: engine.import_kv("new", PROMPT, [head], SP), InvalidBlocks)  # too short
    assert_refused(
        engine, lambda: engine.import_kv("new", PROMPT, [head, head], SP), InvalidBlocks
    )  # overlap
    assert_refused(engine, lambda: engine.import_kv("new", PROMPT[:-3], [kb], SP), InvalidBlocks)  # too long
    # a prefix this engine does not hold, or a reuse that is not a whole number of blocks
    assert_refused(
        engine,
        lambda: engine.import_kv("new", PROMPT, [tail], SP, reuse_prefix_tokens=BLOCK * 3),
        InvalidBlocks,
    )
    assert_refused(
        engine,
        lambda: engine.import_kv("new", PROMPT, [tail], SP, reuse_prefix_tokens=BLOCK - 1),
        InvalidBlocks,
    )
    with pytest.raises(InvalidBlocks):  # a payload of the wrong size never becomes a KVBlocks
        KVBlocks(kb.layout, 0, kb.num_blocks, kb.num_tokens, bytes(kb.data)[:-1])


def test_layout_mismatch(engine: PagedEngine) -> None:
    kb = exported_prompt(engine)
    for change in ({"model_id": "another-model"}, {"dtype": "float32"}, {"block_size": BLOCK * 2}):
        other = replace(kb.layout, **change)
        nbytes = -(-len(PROMPT) // other.block_size) * other.bytes_per_block
        foreign = KVBlocks(other, 0, -(-len(PROMPT) // other.block_size), len(PROMPT), bytes(nbytes))
        assert_refused(engine, lambda f=foreign: engine.import_kv("new", PROMPT, [f], SP), LayoutMismatch)


def test_pool_exhausted_changes_nothing(engine: PagedEngine) -> None:
    huge = list(range(1, 1 + BLOCK * 70))  # more blocks than the 64-block pool holds
    assert_refused(engine, lambda: engine.prefill("huge", huge, SP), PoolExhausted)
    lay = engine.layout
    n = len(huge) // BLOCK
    zeros = KVBlocks(lay, 0, n, len(huge), bytes(n * lay.bytes_per_block))
    assert_refused(engine, lambda: engine.import_kv("huge", huge, [zeros], SP), PoolExhausted)
    free = engine.free_blocks
    engine.prefill("fits", list(range(1, 1 + BLOCK * free)), SP)  # takes every block left
    assert_refused(engine, lambda: engine.decode(["live", "fits"]), PoolExhausted)


def test_engine_errors_are_pddlink_errors() -> None:
    assert issubclass(InvalidTokens, InvalidInput) and issubclass(InvalidRequest, InvalidInput)
    assert issubclass(InvalidBlocks, InvalidInput)
