"""``pddlink bench engine``: prefill, decode and extend speed of the torch reference engine.

Everything is measured in one run on one model. The figure that matters is the last pair: KV of
100 tokens recomputed by one ``extend`` (what MainDecode does at a handoff) against the same 100
tokens decoded one step at a time (what producing them cost RelayDecode). Both start from the same
state (the same prompt, its first token pending) and compute the KV of the same 100 tokens; the
extend is fed the very tokens the decode run produced. The default preset is ``small``: on a CPU
its steps are dominated by arithmetic rather than Python overhead, so the ratio means something.
It runs on one thread by default, as each engine does in the sidecar (``--threads 0``: all cores).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import click
from tqdm import tqdm

from pddlink.errors import ConfigError

HANDOFF_TOKENS = 100


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _decode_steps(engine: Any, rid: str, steps: int) -> list[Any]:
    return [engine.decode([rid])[0] for _ in range(steps)]


def run_bench(
    *,
    preset: str,
    dtype: str,
    device: str,
    prompt_tokens: int,
    repeats: int,
    decode_steps: int,
    threads: int | None,
    progress: bool,
) -> dict[str, Any]:
    """Run every measurement on one engine and return the figures (the JSON object)."""
    import torch

    from engines_adapter.base import SamplingParams
    from engines_adapter.torch_ref import TorchRefEngine

    if threads:
        torch.set_num_threads(threads)
    engine = TorchRefEngine(preset, dtype=dtype, device=device, num_blocks=4096)
    if prompt_tokens + HANDOFF_TOKENS + decode_steps + 2 > engine.max_positions:
        raise ConfigError(
            f"--prompt-tokens {prompt_tokens} leaves no room in max_positions {engine.max_positions}"
        )
    rng = random.Random(0)
    sampling = SamplingParams(max_tokens=HANDOFF_TOKENS + decode_steps + 8)
    counter = iter(range(1_000_000))

    def fresh_prompt() -> list[int]:
        return [rng.randrange(engine.vocab_size) for _ in range(prompt_tokens)]

    def prefill(prompt: list[int]) -> str:
        rid = f"bench-{next(counter)}"
        engine.prefill(rid, prompt, sampling)
        return rid

    steps = 1 + repeats + 2 + 2 * repeats
    bar = tqdm(total=steps, desc="bench engine", unit="phase", disable=not progress, leave=False)
    prefill(fresh_prompt())  # warm-up: first-call allocations and kernel selection
    bar.update()
    prefill_s = []
    for _ in range(repeats):
        dt, rid = _timed(lambda: prefill(fresh_prompt()))
        prefill_s.append(dt)
        engine.release(rid, cache_prefix=False)
        bar.update()

    decode_ms: dict[str, float] = {}
    for batch in (1, 8):
        rids = [prefill(fresh_prompt()) for _ in range(batch)]
        engine.decode(rids)  # warm-up step
        per_step = [_timed(partial(engine.decode, rids))[0] for _ in range(decode_steps)]
        decode_ms[str(batch)] = statistics.median(per_step) * 1e3
        for r in rids:
            engine.release(r, cache_prefix=False)
        bar.update()

    extend_s, decode100_s, agree = [], [], True
    for _ in range(repeats):
        prompt = fresh_prompt()
        rid = prefill(prompt)
        dt, outs = _timed(partial(_decode_steps, engine, rid, HANDOFF_TOKENS))
        decode100_s.append(dt)
        generated = engine.tokens(rid)[
            prompt_tokens:
        ]  # t0 .. t100; the decode steps computed KV of t0 .. t99
        engine.release(rid, cache_prefix=False)
        bar.update()
        other = prefill(prompt)
        dt, out = _timed(partial(engine.extend, other, generated[:HANDOFF_TOKENS]))
        extend_s.append(dt)
        agree = agree and out.token_id == outs[-1].token_id
        engine.release(other, cache_prefix=False)
        bar.update()
    bar.close()

    extend_ms = statistics.median(extend_s) * 1e3
    decode100_ms = statistics.median(decode100_s) * 1e3
    return {
        "prefill_tokens_per_s": prompt_tokens / statistics.median(prefill_s),
        "decode_step_ms": decode_ms,
        "extend_100_ms": extend_ms,
        "decode_100_ms": decode100_ms,
        "extend_speedup": decode100_ms / extend_ms,
        "extend_matches_decode": agree,
        "decode_tokens_per_s": {b: int(b) * 1e3 / ms for b, ms in decode_ms.items()},
        "preset": preset,
        "parameters": engine.config.num_parameters,
        "dtype": dtype,
        "device": device,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "kv_bytes_per_token": engine.layout.bytes_per_token,
    }


@click.command(name="engine")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object on stdout (progress goes to stderr)."
)
@click.option(
    "--preset",
    default="small",
    show_default=True,
    help="Model shape: tiny, small, medium or llama-1b (random weights from a fixed seed).",
)
@click.option(
    "--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float64"])
)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option(
    "--prompt-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(16, 100_000),
    help="Prompt length for prefill and the context of decode and extend.",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1, 50),
    help="Repetitions of prefill and of the extend/decode pair; medians are reported.",
)
@click.option(
    "--decode-steps",
    default=20,
    show_default=True,
    type=click.IntRange(1, 10_000),
    help="Timed decode steps per batch size.",
)
@click.option(
    "--threads",
    default=1,
    show_default=True,
    type=click.IntRange(0, 1024),
    help="torch intra-op threads; 0 keeps torch's default (all cores). One thread gives steadier "
    "figures on a shared machine and is how the sidecar runs each engine.",
)
def command(
    as_json: bool,
    preset: str,
    dtype: str,
    device: str,
    prompt_tokens: int,
    repeats: int,
    decode_steps: int,
    threads: int | None,
) -> None:
    """Prefill tokens/s, decode step time at batch 1 and 8, and extend(100) against 100 decode steps.

    All figures come from one engine in one run. The extend/decode ratio is the premise of the
    token-id handoff: recomputing 100 tokens' KV must cost far less than generating them.
    """
    figures = run_bench(
        preset=preset,
        dtype=dtype,
        device=device,
        prompt_tokens=prompt_tokens,
        repeats=repeats,
        decode_steps=decode_steps,
        threads=threads,
        progress=True,
    )
    if as_json:
        click.echo(json.dumps(figures))
        return
    click.echo(
        f"engine: torch_ref preset {preset} ({figures['parameters'] / 1e6:.1f} M parameters), {dtype} on "
        f"{device}, {figures['threads']} thread(s), prompt {prompt_tokens} tokens"
    )
    click.echo(f"  prefill            {figures['prefill_tokens_per_s']:10.0f} tokens/s")
    for b, ms in figures["decode_step_ms"].items():
        click.echo(f"  decode step (B={b}) {ms:10.2f} ms")
    click.echo(f"  extend 100 tokens  {figures['extend_100_ms']:10.1f} ms")
    click.echo(
        f"  100 decode steps   {figures['decode_100_ms']:10.1f} ms  "
        f"(extend is {figures['extend_speedup']:.1f}x cheaper)"
    )
