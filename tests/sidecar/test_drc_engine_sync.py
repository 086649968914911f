"""MD's DRC and its engine's pool stay aligned when the pool drops cached blocks on its own.

A real reference engine with a small pool, and a DRC whose capacity is larger than the pool (the
drift the sidecar's 3/4 sizing keeps rare): a long prompt forces the pool to evict cached blocks,
and the next DRC call must forget them (and what hung below them) before it answers. The same
report must cross the engine link's command codec.
"""

from __future__ import annotations

import random
import time

import pytest

from engines_adapter import link_codec as codec
from engines_adapter.base import SamplingParams
from engines_adapter.drc_host import DrcHost
from engines_adapter.torch_ref import TorchRefEngine
from pddlink.drc import BlocksRemoved, RefusalReason, ReservationRefused
from pddlink.serving.proto_gen import pddlink_engine_pb2 as pb2

BLOCK = 4
SP = SamplingParams(max_tokens=3)


def _prompt(blocks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(blocks * BLOCK)]


def _engine(num_blocks: int) -> TorchRefEngine:
    return TorchRefEngine("tiny", dtype="float32", block_size=BLOCK, num_blocks=num_blocks, seed=1)


def _serve(engine: TorchRefEngine, drc: DrcHost, rid: str, prompt: list[int]) -> list[int]:
    """Run a request to the end, cache its blocks, record them in the DRC; returns its tokens."""
    out = engine.prefill(rid, prompt, SP)
    while not out.finished:
        out = engine.decode([rid])[0]
    tokens = engine.tokens(rid)
    engine.release(rid, cache_prefix=True)
    drc.insert(tokens[:-1])
    return tokens


def _index_within_engine(drc: DrcHost, engine: TorchRefEngine) -> None:
    """Every block the index holds is in the engine's pool, with its whole prefix."""
    cached = set(engine.pool.allocator._block_of)
    held = {h for h, _ in drc.index.blocks()}
    assert held <= cached, f"{len(held - cached)} indexed blocks are gone from the engine"


@pytest.mark.timeout(60)
def test_blocks_the_pool_drops_are_forgotten_before_the_next_answer() -> None:
    engine = _engine(num_blocks=24)
    drc = DrcHost(engine, capacity_blocks=1000)
    first = _prompt(10, 1)
    _serve(engine, drc, "a", first)
    chain = drc.hasher.hash_blocks(first)
    assert drc.index.match(chain).matched_blocks == 10
    held, synced = drc.reserve("r0", chain, lease_s=30.0)
    assert held.cached_blocks == 10 and synced == []

    out = engine.prefill("b", _prompt(18, 2), SP)  # 18 + 1 blocks: the pool must drop a's blocks
    assert not out.finished
    dropped_by_pool = len(engine.pool.allocator._evicted)
    assert dropped_by_pool > 0

    _, synced = drc.reserve("r1", chain, lease_s=30.0)  # the sync runs before the answer
    removed = [h for ev in synced if isinstance(ev, BlocksRemoved) for h in ev.hashes]
    assert removed, "the engine's own evictions must become index events"
    left = engine.cached_prefix_tokens(first) // BLOCK
    assert drc.index.match(chain).matched_blocks == left < 10
    _index_within_engine(drc, engine)
    with pytest.raises(ReservationRefused) as refused:  # r0's pinned prefix went with the pool
        drc.index.release("r0", time.monotonic())
    assert refused.value.reason is RefusalReason.EVICTED
    engine.decode(["b"])
    engine.release("b", cache_prefix=False)


@pytest.mark.timeout(60)
def test_a_long_run_under_pressure_never_leaves_stale_index_entries() -> None:
    engine = _engine(num_blocks=40)
    drc = DrcHost(engine, capacity_blocks=1000)
    rng = random.Random(5)
    bases = [_prompt(6, 100 + i) for i in range(3)]
    for i in range(25):  # shared prefixes, varied tails: the pool is short most of the time
        prompt = rng.choice(bases)[: BLOCK * rng.randrange(2, 7)] + _prompt(rng.randrange(1, 6), i)
        _serve(engine, drc, f"q{i}", prompt)
        _index_within_engine(drc, engine)
        assert drc.index.match(drc.hasher.hash_blocks(prompt)).matched_blocks * BLOCK == (
            engine.cached_prefix_tokens(prompt)
        )
    assert drc.index.stats().evicted_blocks > 0, "the run should have put the pool under pressure"


def test_the_engine_link_carries_the_pools_evictions() -> None:
    engine = _engine(num_blocks=12)
    engine.prefill("a", _prompt(8, 3), SP)
    engine.release("a", cache_prefix=True)
    engine.prefill("b", _prompt(9, 4), SP)  # needs cached blocks back
    expected = list(engine.pool.allocator._evicted)
    assert expected
    plan = codec.plan_drain_evicted_hashes()
    cmd = pb2.Command(command_id=1, **{plan.op: plan.msg})
    reply = codec.execute(engine, cmd, time.monotonic())
    assert plan.unpack(reply) == expected
    assert engine.drain_evicted_hashes() == []  # drained: reported once
