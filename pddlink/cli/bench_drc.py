"""``pddlink bench drc``: prefix match (hashing included), insert rate and memory of the DRC index.

The match figure is the router's and MD's hot path: a 64K-token prompt arrives as a Python list of
token ids (as everywhere in the project), is packed, hashed into chained blocks and matched against
the index; ``match_from_uint32_array_us`` starts from packed uint32 ids instead (no list conversion).
``hasher`` says whether lists are hashed by the C extension (``native``) or in pure Python;
``match_python_us`` is the same match through the pure-Python hashing path, timed in the same rounds,
so the extension's gain is measured side by side (equal to ``match_us`` where it is not built).
The baseline, measured in the same run on the same cached prompts and the same query, is a
token-list radix tree of the kind SGLang uses (``pddlink.drc.baseline``) at the same page size; both
must find the same cached length. The variants are timed interleaved, in a shuffled order each
round, so that machine noise falls on all alike. Then the index is grown to one million blocks:
match time, memory, eviction-bound insert rate and snapshot size there.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import click
import numpy as np
from tqdm import tqdm

from pddlink.drc import Mirror, PrefixIndex, decode_event, decode_snapshot, encode_event, encode_snapshot
from pddlink.drc.baseline import TokenRadixTree
from pddlink.errors import ConfigError
from pddlink.kv import hashing
from pddlink.kv.hashing import BlockHasher, token_buffer

VOCAB = 150_000


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    # min: the cost with the CPU to itself, a useful second figure on a shared, busy machine
    return {
        "p50": round(statistics.median(ordered) * 1e6, 1),
        "p99": round(p99 * 1e6, 1),
        "min": round(ordered[0] * 1e6, 1),
    }


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def random_chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(128) for _ in range(n)]


class Workload:
    """Cached prompts that share prefixes of a base prompt, and a query that hits most of one."""

    def __init__(self, prompt_tokens: int, block_size: int, seed: int) -> None:
        rng = random.Random(seed)
        self.base = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
        step = max(block_size, (prompt_tokens // 16) // block_size * block_size)
        self.cached = [
            self.base[:cut] + [rng.randrange(VOCAB) for _ in range(prompt_tokens - cut)]
            for cut in range(0, prompt_tokens, step)
        ]
        self.hit_tokens = (prompt_tokens - step) // block_size * block_size
        fresh = [rng.randrange(VOCAB) for _ in range(prompt_tokens - self.hit_tokens)]
        self.query = self.base[: self.hit_tokens] + fresh


def bench_match(work: Workload, hasher: BlockHasher, repeat: int) -> dict[str, Any]:
    index = PrefixIndex()
    tree = TokenRadixTree(page_size=hasher.block_size)
    tree_page1 = TokenRadixTree(page_size=1)
    for prompt in work.cached:
        index.insert(hasher.hash_blocks(prompt), now=0.0)
        tree.insert(prompt)
        tree_page1.insert(prompt)
    query, array = work.query, np.asarray(work.query, dtype=np.uint32)
    ours = index.match(hasher.hash_blocks(query)).matched_blocks * hasher.block_size
    theirs = {tree.match_prefix(query), tree_page1.match_prefix(query)}
    if theirs != {ours} or ours != work.hit_tokens:
        raise AssertionError(
            f"trees disagree: index {ours}, token trees {theirs}, expected {work.hit_tokens}"
        )
    hashes = hasher.hash_blocks(query)
    if hasher.hash_block_bytes(token_buffer(query)) != hashes:
        raise AssertionError("the native and the pure-Python hashing paths disagree")
    variants: dict[str, Callable[[], object]] = {
        "match": lambda: index.match(hasher.hash_blocks(query)),
        "match_python": lambda: index.match(hasher.hash_block_bytes(token_buffer(query))),
        "baseline": lambda: tree.match_prefix(query),
        "hash": lambda: hasher.hash_blocks(query),
        "lookup": lambda: index.match(hashes),
        "array": lambda: index.match(hasher.hash_blocks(array)),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = random.Random(repeat)
    for _ in tqdm(range(repeat), desc="match vs token tree", file=sys.stderr, leave=False):
        names = list(variants)
        order.shuffle(names)  # no variant always runs right after the long baseline
        for name in names:
            samples[name].append(timed(variants[name]))
    match_s, base_s, hash_s = samples["match"], samples["baseline"], samples["hash"]
    lookup_s, array_s = samples["lookup"], samples["array"]
    page1_s = [timed(lambda: tree_page1.match_prefix(query)) for _ in range(max(5, repeat // 10))]
    return {
        "match_us": percentiles(match_s),
        "hasher": "native" if hashing.NATIVE else "python",
        "match_python_us": percentiles(samples["match_python"]),
        "baseline_match_us": percentiles(base_s),
        "baseline": f"token-list radix tree, page size {hasher.block_size} (same cached prompts and query)",
        "baseline_page1_match_us": percentiles(page1_s),
        "hash_us": percentiles(hash_s),
        "lookup_us": percentiles(lookup_s),
        "match_from_uint32_array_us": percentiles(array_s),
        "cached_fraction": work.hit_tokens / len(query),
    }


def bench_insert(blocks: int, chain_blocks: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    chains = [random_chain(rng, chain_blocks) for _ in range(max(1, blocks // chain_blocks))]
    index = PrefixIndex()
    free_s = sum(timed(lambda c=c: index.insert(c, now=0.0)) for c in chains)  # type: ignore[misc]
    full = PrefixIndex(capacity_blocks=len(index))
    for c in chains:
        full.insert(c, now=0.0)
    fresh = [random_chain(rng, chain_blocks) for _ in chains]
    evict_s = sum(timed(lambda c=c: full.insert(c, now=1.0)) for c in fresh)  # type: ignore[misc]
    n = len(chains) * chain_blocks
    return {"insert_blocks_per_s": round(n / free_s), "insert_with_eviction_blocks_per_s": round(n / evict_s)}


def traced_bytes_per_block(blocks: int, chain_blocks: int, seed: int) -> dict[str, float]:
    """Memory the index (and a mirror) keep per block, hash ints included, by tracemalloc."""
    rng = random.Random(seed)
    tracemalloc.start()
    index = PrefixIndex()
    events = []
    for _ in range(max(1, blocks // chain_blocks)):
        events.extend(index.insert(random_chain(rng, chain_blocks), now=0.0))
    index_bytes = tracemalloc.get_traced_memory()[0]
    mirror = Mirror()
    for ev in events:  # through the byte form: a mirror in another process holds its own ints
        mirror.apply(decode_event(encode_event(ev)), now=0.0)
    del events
    mirror_bytes = tracemalloc.get_traced_memory()[0] - index_bytes
    tracemalloc.stop()
    n = len(index)
    snapshot = encode_snapshot(index)
    return {
        "bytes_per_block": round(index_bytes / n, 1),
        "mirror_bytes_per_block": round(mirror_bytes / n, 1),
        "snapshot_bytes_per_block": round(len(snapshot) / n, 2),
    }


def bench_million(work: Workload, hasher: BlockHasher, blocks: int, repeat: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    chain_blocks = len(work.query) // hasher.block_size
    tracemalloc.start()
    start = time.perf_counter()
    index = PrefixIndex(capacity_blocks=blocks)
    for prompt in work.cached:
        index.insert(hasher.hash_blocks(prompt), now=0.0)
    for _ in tqdm(range(blocks // chain_blocks), desc="grow to 1M blocks", file=sys.stderr, leave=False):
        index.insert(random_chain(rng, min(chain_blocks, blocks - len(index)) or 1), now=0.0)
    build_s = time.perf_counter() - start
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    for prompt in work.cached:  # recently used: keep them while the eviction test runs
        index.access(hasher.hash_blocks(prompt), now=1.0)
    query = work.query
    match_s = [timed(lambda: index.match(hasher.hash_blocks(query))) for _ in range(repeat)]
    found = index.match(hasher.hash_blocks(query)).matched_blocks * hasher.block_size
    fresh = [random_chain(rng, chain_blocks) for _ in range(20)]
    evict_s = sum(timed(lambda c=c: index.insert(c, now=2.0)) for c in fresh)  # type: ignore[misc]
    encode_s = timed(lambda: encode_snapshot(index))
    snapshot = encode_snapshot(index)
    decode_s = timed(lambda: decode_snapshot(snapshot))
    mirror = Mirror()
    load_s = timed(lambda: mirror.load_snapshot(decode_snapshot(snapshot), now=0.0))
    return {
        "cached_blocks": len(index),
        "build_s_under_tracemalloc": round(build_s, 2),
        "memory_mib": round(memory / 2**20, 1),
        "bytes_per_block": round(memory / len(index), 1),
        "match_us": percentiles(match_s),
        "matched_tokens": found,
        "insert_with_eviction_blocks_per_s": round(len(fresh) * chain_blocks / evict_s),
        "snapshot_mib": round(len(snapshot) / 2**20, 1),
        "snapshot_encode_ms": round(encode_s * 1e3, 1),
        "snapshot_decode_ms": round(decode_s * 1e3, 1),
        "mirror_resync_ms": round(load_s * 1e3, 1),
    }


@click.command(name="drc")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--prompt-tokens", default=65536, show_default=True)
@click.option(
    "--block-size", default=64, show_default=True, help="Tokens per block (and the tree's page size)."
)
@click.option("--repeat", default=200, show_default=True, help="Timed matches per variant.")
@click.option(
    "--large-blocks", default=1_000_000, show_default=True, help="Index size for the at-scale part; 0 skips."
)
@click.option("--seed", default=1, show_default=True)
def command(
    as_json: bool, prompt_tokens: int, block_size: int, repeat: int, large_blocks: int, seed: int
) -> None:
    """Prefix match, insert rate and memory of the DRC index, against a token-list radix tree."""
    if prompt_tokens < block_size or block_size < 1 or repeat < 1 or large_blocks < 0:
        raise ConfigError("need prompt_tokens >= block_size >= 1, repeat >= 1, large_blocks >= 0")
    hasher = BlockHasher("bench-drc", block_size)
    work = Workload(prompt_tokens, block_size, seed)
    result: dict[str, Any] = {"prompt_tokens": prompt_tokens, "block_size": block_size, "repeat": repeat}
    result.update(bench_match(work, hasher, repeat))
    result["speedup_p50"] = round(result["baseline_match_us"]["p50"] / result["match_us"]["p50"], 2)
    result.update(bench_insert(200_000, prompt_tokens // block_size, seed))
    result.update(traced_bytes_per_block(100_000, prompt_tokens // block_size, seed))
    if large_blocks:
        result["at_1m_blocks" if large_blocks == 1_000_000 else f"at_{large_blocks}_blocks"] = bench_million(
            work, hasher, large_blocks, max(20, repeat // 4), seed
        )
    if as_json:
        click.echo(json.dumps(result))
        return
    m, b = result["match_us"], result["baseline_match_us"]
    click.echo(f"match {prompt_tokens} tokens (hash + lookup): p50 {m['p50']} us, p99 {m['p99']} us")
    click.echo(f"token-list tree:                  p50 {b['p50']} us, p99 {b['p99']} us")
    click.echo(f"hashing: {result['hasher']}; pure-Python path p50 {result['match_python_us']['p50']} us")
    click.echo(f"speedup {result['speedup_p50']}x at p50; insert {result['insert_blocks_per_s']} blocks/s")
    click.echo(f"memory {result['bytes_per_block']} bytes/block (mirror {result['mirror_bytes_per_block']})")
    for key, value in result.items():
        if key.startswith("at_"):
            click.echo(f"{key}: {json.dumps(value)}")
