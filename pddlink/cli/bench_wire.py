"""``pddlink bench wire``: the frame decoder under a flood of mutated and random frames.

Feeds ``--frames`` (default 1,000,000) frames from ``pddlink.wire.fuzz.FrameFuzzer`` (valid frames
of every type, bit flips, truncations, splices, random headers and bodies with valid CRCs, random
bytes; whole or split) each to a fresh decoder, and reports the rate, the error types seen, the
largest decoder buffer, and the process's peak RSS growth. Any exception that is not a
``WireError`` is counted under ``untyped_errors`` and makes the command exit 1. The baseline, in the
same run, is the decoder on a stream of valid frames only. On a shared machine the wall-clock rate
is noisy; ``frames_per_cpu_s`` (process CPU time) is the steadier figure. ``--json`` prints one object::

    {"frames", "seconds", "frames_per_s", "cpu_seconds", "frames_per_cpu_s", "messages",
     "errors": {type: count}, "untyped_errors", "max_buffered_bytes", "peak_rss_growth_bytes",
     "baseline": {"valid_frames_per_s"},
     "handoff_100_tokens_bytes", "seed"}
"""

from __future__ import annotations

import json
import random
import resource
import sys
import time
from typing import Any

import click
from tqdm import tqdm

from pddlink.wire import Decoder, Handoff, WireError, encode
from pddlink.wire.fuzz import FrameFuzzer, FuzzReport, corpus


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def valid_stream_rate(frames: int, seed: int) -> float:
    """Messages per second decoding one stream of valid frames fed in 64 KiB reads."""
    rng = random.Random(seed)
    samples = [encode(m) for m in corpus()]
    stream = b"".join(rng.choice(samples) for _ in range(frames))
    dec = Decoder()
    start = time.perf_counter()
    count = 0
    for pos in range(0, len(stream), 65536):
        count += len(dec.feed(stream[pos : pos + 65536]))
    elapsed = time.perf_counter() - start
    if count != frames:
        raise click.ClickException(f"baseline decoded {count} of {frames} valid frames")
    return frames / elapsed


def handoff_100_tokens_bytes(seed: int) -> int:
    rng = random.Random(seed)
    msg = Handoff(
        "c0ffee00-1234-4bcd-9abc-0123456789ab", 65_000, tuple(rng.randrange(151_936) for _ in range(100)),
        2**62, 0.7, 50, 0.95, 4096, (151_643, 151_645),
    )  # fmt: skip
    return len(encode(msg))


def fuzz(frames: int, seed: int, quiet: bool) -> tuple[FuzzReport, int, float, float]:
    fuzzer = FrameFuzzer(seed)
    report = FuzzReport()
    untyped = 0
    bar = tqdm(total=frames, desc="fuzz frames", file=sys.stderr, disable=quiet, unit="frame")
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(frames):
        try:
            fuzzer.feed_one(fuzzer.frame(), report)
        except Exception as exc:  # counted and reported: the point of the benchmark
            if isinstance(exc, WireError):
                raise
            untyped += 1
            report.errors[f"untyped:{type(exc).__name__}"] += 1
        if i % 10_000 == 9_999:
            bar.update(10_000)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    bar.close()
    return report, untyped, elapsed, cpu


@click.command(name="wire")
@click.option("--frames", type=click.IntRange(1, 100_000_000), default=1_000_000, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def command(frames: int, seed: int, as_json: bool) -> None:
    """Fuzz the frame decoder: rate, error types, bounded memory."""
    rss_before = _peak_rss_bytes()
    report, untyped, elapsed, cpu = fuzz(frames, seed, quiet=False)
    rss_growth = _peak_rss_bytes() - rss_before
    baseline = valid_stream_rate(min(frames, 100_000), seed)
    result: dict[str, Any] = {
        "frames": report.frames,
        "seconds": round(elapsed, 3),
        "frames_per_s": round(report.frames / elapsed, 1),
        "cpu_seconds": round(cpu, 3),
        "frames_per_cpu_s": round(report.frames / max(cpu, 1e-9), 1),
        "messages": report.messages,
        "errors": dict(report.errors.most_common()),
        "untyped_errors": untyped,
        "max_buffered_bytes": report.max_buffered_bytes,
        "peak_rss_growth_bytes": rss_growth,
        "baseline": {"valid_frames_per_s": round(baseline, 1)},
        "handoff_100_tokens_bytes": handoff_100_tokens_bytes(seed),
        "seed": seed,
    }
    if as_json:
        click.echo(json.dumps(result))
    else:
        for key, value in result.items():
            click.echo(f"{key:>26}: {value}")
    if untyped:
        sys.exit(1)
