"""``pddlink bench codec``: the lossless KV codec against plain zstd, on the same KV bytes.

The KV comes from the reference engine (``torch_ref``) in bf16: random prompts are prefilled and
their blocks exported, as a prefill sidecar would before shipping them (``--source gaussian`` uses
Gaussian bf16 instead, for work without torch). Both codecs see the same chunks (``--chunk-bytes``);
single-thread speeds are bytes per CPU-second of the measuring thread (``time.thread_time``, best
of ``--repeats`` passes), so other processes on a shared machine do not distort a one-core
figure; ``*_wall_gb_per_s`` give the wall-clock view of the same passes. The ``threads`` figures
run the codec's thread pool with 1..N threads and are wall-clock (they measure scaling). Every
frame is decoded and compared with the input, so a lossy codec cannot report figures. ``--json``
prints one object::

    {"dtype", "bytes", "chunk_bytes", "source", "codec": {"ratio", "compress_gb_per_s",
     "decompress_gb_per_s", "compress_wall_gb_per_s", "decompress_wall_gb_per_s"},
     "zstd": {same, "level"}, "threads": {"1": GB/s, "2": GB/s, ...}}
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import click
import numpy as np
import zstandard
from tqdm import tqdm

from pddlink.errors import InvalidInput
from pddlink.kv.codec import ParallelCodec, decode_chunk, encode_chunk, iter_chunks

GB = 1e9


def engine_kv(
    preset: str, dtype: str, prompts: int, prompt_tokens: int, seed: int
) -> tuple[bytes, dict[str, Any]]:
    """KV blocks of ``prompts`` random prompts, prefilled by the reference engine."""
    import torch

    from engines_adapter.base import SamplingParams

    # One intra-op thread: idle OpenMP workers would otherwise spin on the cores the codec is
    # being timed on (the tiny model gains nothing from more threads anyway).
    torch.set_num_threads(1)

    try:
        from engines_adapter import load_engine

        engine = load_engine("torch_ref", preset=preset, dtype=dtype, num_blocks=prompt_tokens // 16 + 8)
    except ImportError:
        from engines_adapter.torch_ref import TorchRefEngine

        engine = TorchRefEngine(preset, dtype=dtype, num_blocks=prompt_tokens // 16 + 8)
    rng = np.random.default_rng(seed)
    parts: list[bytes] = []
    for i in tqdm(range(prompts), desc=f"prefill {preset}/{dtype}", file=sys.stderr, leave=False):
        rid = f"bench-codec-{i}"
        engine.prefill(rid, rng.integers(0, engine.vocab_size, prompt_tokens).tolist(), SamplingParams())
        parts.append(bytes(memoryview(engine.export_kv(rid).data).cast("B")))
        engine.release(rid, cache_prefix=False)
    source = {
        "engine": "torch_ref",
        "preset": preset,
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "layout": engine.layout.to_dict(),
    }
    return b"".join(parts), source


def gaussian_kv(total_bytes: int, seed: int) -> tuple[bytes, dict[str, Any]]:
    """bf16 of N(0, 0.5): float32 draws truncated to their high 16 bits (bf16 round-toward-zero)."""
    draws = np.random.default_rng(seed).standard_normal(total_bytes // 2).astype(np.float32) * 0.5
    return (draws.view(np.uint32) >> 16).astype("<u2").tobytes(), {"engine": "gaussian"}


def best_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best wall-clock, best thread-CPU) seconds of ``repeats`` calls of ``fn``."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu = min(cpu, time.thread_time() - start_cpu)
        wall = min(wall, time.perf_counter() - start_wall)
    return max(wall, 1e-9), max(cpu, 1e-9)


def speeds(
    raw: int, encode: Callable[[], object], decode: Callable[[], object], repeats: int
) -> dict[str, float]:
    """Compress/decompress GB/s per thread CPU-second, and the same passes' wall-clock rates."""
    out: dict[str, float] = {}
    for name, fn in (("compress", encode), ("decompress", decode)):
        wall, cpu = best_seconds(fn, repeats)
        out[f"{name}_gb_per_s"] = raw / cpu / GB
        out[f"{name}_wall_gb_per_s"] = raw / wall / GB
    return out


def measure_codec(chunks: Sequence[memoryview], dtype: str, repeats: int) -> dict[str, float]:
    frames = [encode_chunk(c, dtype) for c in chunks]
    if any(decode_chunk(f) != c for f, c in zip(frames, chunks, strict=True)):
        raise InvalidInput("codec round trip changed the KV bytes")
    raw = sum(len(c) for c in chunks)
    rates = speeds(
        raw,
        lambda: [encode_chunk(c, dtype) for c in chunks],
        lambda: [decode_chunk(f) for f in frames],
        repeats,
    )
    return {"ratio": raw / sum(map(len, frames)), **rates}


def measure_zstd(chunks: Sequence[memoryview], level: int, repeats: int) -> dict[str, float]:
    comp, decomp = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    frames = [comp.compress(c) for c in chunks]
    raw = sum(len(c) for c in chunks)
    rates = speeds(
        raw,
        lambda: [comp.compress(c) for c in chunks],
        lambda: [decomp.decompress(f) for f in frames],
        repeats,
    )
    return {"ratio": raw / sum(map(len, frames)), **rates, "level": level}


def measure_threads(
    chunks: Sequence[memoryview], dtype: str, max_threads: int, repeats: int
) -> dict[str, float]:
    raw = sum(len(c) for c in chunks)
    out: dict[str, float] = {}
    for n in range(1, max_threads + 1):
        with ParallelCodec(n) as pool:
            out[str(n)] = raw / best_seconds(lambda p=pool: p.encode_all(chunks, dtype), repeats)[0] / GB  # type: ignore[misc]
    return out


@click.command(name="codec")
@click.option("--source", type=click.Choice(["engine", "gaussian"]), default="engine", show_default=True)
@click.option("--preset", default="tiny", show_default=True, help="reference engine preset")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--prompts", type=click.IntRange(1), default=32, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(16), default=512, show_default=True)
@click.option("--gaussian-bytes", type=click.IntRange(2), default=16 << 20, show_default=True)
@click.option("--chunk-bytes", type=click.IntRange(4096, 64 << 20), default=1 << 20, show_default=True)
@click.option("--zstd-level", type=click.IntRange(-7, 22), default=1, show_default=True)
@click.option("--repeats", type=click.IntRange(1), default=15, show_default=True)
@click.option(
    "--threads",
    "max_threads",
    type=click.IntRange(1, 64),
    default=None,
    help="largest thread count to measure [max(2, CPUs)]",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
def command(
    source: str,
    preset: str,
    dtype: str,
    prompts: int,
    prompt_tokens: int,
    gaussian_bytes: int,
    chunk_bytes: int,
    zstd_level: int,
    repeats: int,
    max_threads: int | None,
    seed: int,
    as_json: bool,
) -> None:
    """Lossless KV codec ratio and speed against plain zstd on the same KV."""
    if source == "engine":
        data, origin = engine_kv(preset, dtype, prompts, prompt_tokens, seed)
    else:
        data, origin = gaussian_kv(gaussian_bytes, seed)
        dtype = "bfloat16"
    chunks = list(iter_chunks(data, chunk_bytes, 2 if dtype == "bfloat16" else 4))
    click.echo(f"measuring {len(data)} bytes of {dtype} KV in {len(chunks)} chunks", err=True)
    result: dict[str, Any] = {
        "dtype": dtype,
        "bytes": len(data),
        "chunk_bytes": chunk_bytes,
        "source": origin,
        "codec": measure_codec(chunks, dtype, repeats),
        "zstd": measure_zstd(chunks, zstd_level, repeats),
        "threads": measure_threads(chunks, dtype, max_threads or max(2, os.cpu_count() or 1), repeats),
    }
    if as_json:
        click.echo(json.dumps(result))
        return
    c, z = result["codec"], result["zstd"]
    click.echo(f"{dtype} KV, {len(data)} bytes ({origin['engine']}), chunks of {chunk_bytes} bytes")
    for name, r in (("codec", c), (f"zstd -{zstd_level}", z)):
        click.echo(
            f"  {name:10s} ratio {r['ratio']:.3f}  compress {r['compress_gb_per_s']:.2f} GB/s  "
            f"decompress {r['decompress_gb_per_s']:.2f} GB/s"
        )
    click.echo("  threads    " + "  ".join(f"{k}: {v:.2f} GB/s" for k, v in result["threads"].items()))
