"""Prefix reuse on the reference engine: blocks cached under BlockHasher's chained hashes.

Reuse must be invisible in the output (same tokens as a cold engine) and visible in the pool
(fewer blocks taken); release(cache_prefix=...) and evict_prefix_blocks control what stays; the
pool evicts least-recently-used cached blocks under pressure and reports their hashes.
"""

from __future__ import annotations

import random

from _engine_testkit import BLOCK, generate_alone, torch_engine

from engines_adapter.base import SamplingParams
from pddlink.kv.hashing import BlockHasher

SP = SamplingParams(max_tokens=6)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2048) for _ in range(n)]


def test_cached_prefix_is_reused_and_gives_the_same_tokens() -> None:
    shared = _prompt(10 * BLOCK, 1)
    first, second = [*shared, *_prompt(7, 2)], [*shared, *_prompt(9, 3)]
    warm, cold = torch_engine(), torch_engine()
    assert warm.cached_prefix_tokens(second) == 0
    generate_alone(warm, "a", first, SP)
    warm.release("a")
    assert warm.cached_prefix_tokens(second) == len(shared)
    free_before = warm.pool.allocator.num_free
    got = generate_alone(warm, "b", second, SP)
    assert got == generate_alone(cold, "b", second, SP)
    taken = free_before - warm.pool.allocator.num_free
    assert taken == -(-(len(second) + SP.max_tokens - 1) // BLOCK) - len(shared) // BLOCK


def test_live_requests_share_prompt_blocks_at_once() -> None:
    eng = torch_engine()
    prompt = _prompt(8 * BLOCK + 1, 4)
    eng.prefill("a", prompt, SP)
    free = eng.pool.allocator.num_free
    eng.prefill("b", prompt, SP)  # a's full prompt blocks are cached as soon as they are computed
    assert free - eng.pool.allocator.num_free == 1  # only the partial last block is new
    assert eng.tokens("a") == eng.tokens("b")


def test_whole_prompt_cached_still_computes_the_last_token() -> None:
    eng, cold = torch_engine(), torch_engine()
    prompt = _prompt(6 * BLOCK, 5)
    generate_alone(eng, "a", prompt, SP)
    eng.release("a")
    assert eng.cached_prefix_tokens(prompt) == len(prompt)
    assert generate_alone(eng, "b", prompt, SP) == generate_alone(cold, "b", prompt, SP)


def test_cache_keys_are_the_chained_block_hashes() -> None:
    eng = torch_engine()
    prompt = _prompt(5 * BLOCK + 2, 6)
    generate_alone(eng, "a", prompt, SP)
    tokens = eng.tokens("a")
    eng.release("a")
    hasher = BlockHasher(eng.layout.model_id, BLOCK)
    kv_tokens = len(tokens) - 1  # the last sampled token never had its KV computed
    hashes = hasher.hash_blocks(tokens[:kv_tokens])
    assert eng.cached_prefix_tokens(tokens[:kv_tokens]) == len(hashes) * BLOCK
    assert eng.evict_prefix_blocks(hashes[3:]) == len(hashes) - 3
    assert eng.cached_prefix_tokens(prompt) == 3 * BLOCK
    assert eng.evict_prefix_blocks(hashes[3:]) == 0  # already gone
    assert eng.evict_prefix_blocks([12345]) == 0


def test_release_without_cache_frees_everything_it_owned() -> None:
    eng = torch_engine(num_blocks=64)
    prompt = _prompt(7 * BLOCK, 7)
    generate_alone(eng, "a", prompt, SP)
    eng.release("a", cache_prefix=False)
    assert eng.cached_prefix_tokens(prompt) == 0
    assert eng.pool.allocator.num_free == 64


def test_evicting_a_block_in_use_takes_effect_on_release() -> None:
    eng = torch_engine(num_blocks=64)
    prompt = _prompt(4 * BLOCK, 8)
    eng.prefill("a", prompt, SP)
    hashes = BlockHasher(eng.layout.model_id, BLOCK).hash_blocks(prompt)
    assert eng.evict_prefix_blocks(hashes) == 4
    assert eng.cached_prefix_tokens(prompt) == 0
    assert eng.tokens("a")[: len(prompt)] == prompt  # the live request keeps its KV
    eng.decode(["a"])
    eng.release("a")
    assert eng.pool.allocator.num_free == 64 - eng.pool.allocator.num_cached


def test_lru_eviction_under_pressure_reports_hashes() -> None:
    eng = torch_engine(num_blocks=16)
    old, new = _prompt(8 * BLOCK, 9), _prompt(8 * BLOCK, 10)
    eng.prefill("old", old, SP)
    eng.release("old")  # its 8 full prompt blocks stay cached
    cached_old = eng.cached_prefix_tokens(old)
    assert cached_old == 8 * BLOCK
    assert eng.drain_evicted_hashes() == []
    eng.prefill("new", new, SP)  # needs 8 of 16: free ones first, nothing evicted
    assert eng.drain_evicted_hashes() == []
    eng.prefill("new2", _prompt(3 * BLOCK, 11), SP)  # needs 3 more: three of old's cached blocks go
    evicted = eng.drain_evicted_hashes()
    old_hashes = BlockHasher(eng.layout.model_id, BLOCK).hash_blocks(old)
    assert evicted == old_hashes[:-4:-1]  # deepest first: the chain's root survives
    assert eng.cached_prefix_tokens(old) == 5 * BLOCK
