"""``pddlink bench extend --engine vllm``: the handoff's premise measured on vLLM.

At a handoff MainDecode gets the prompt plus the k tokens RelayDecode generated and recomputes
their KV in one forward pass (a prefill of prompt + k ids with the prompt already in vLLM's prefix
cache), instead of decoding them one by one. This bench measures both on the same vLLM instance in
the same run, ``--repeats`` times on fresh prompts, and reports the medians and their ratio:

- decode: the prompt (cached) with ``max_tokens = k + 1``, greedy; the time from the step that
  yields the first output token to the step that yields token k + 1, i.e. k decode steps, each
  computing the KV of one token;
- extend: the prefix cache reset and the prompt alone cached again (so the decoded tokens' KV is
  not), then prompt + the k tokens the decode produced, ``max_tokens = 1``; the time from
  ``add_request`` to the step that yields its token (one scheduler step computing k tokens' KV).

The extend's token must equal the decode's token k + 1 (``extend_matches_decode``; on CPU vLLM is
not batch-invariant, so a near-tie could flip it and is reported, not hidden), and vLLM's own
``num_cached_tokens`` shows the prompt really came from the cache. vLLM runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and steps through ``LLM.llm_engine.step()``; by default on
the project's tiny random Llama built locally (``--model`` takes any model directory).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click

HANDOFF_TOKENS = 100


def _stepped(
    engine: Any, rid: str, prompt: list[int], params: Any
) -> tuple[float, list[tuple[float, int]], Any]:
    """Run one request alone through ``engine.step()``: (time added, [(time, tokens so far)], last output)."""
    t_add = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    stamps: list[tuple[float, int]] = []
    while True:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id != rid:
                continue
            stamps.append((now, len(out.outputs[0].token_ids)))
            if out.finished:
                return t_add, stamps, out
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"request {rid} ended without output")


def _first_at(stamps: list[tuple[float, int]], n: int) -> float:
    return next(t for t, count in stamps if count >= n)


def run_bench(
    *, model: str | None, dtype: str, prompt_tokens: int, tokens: int, repeats: int, block_size: int
) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the JSON's
    from vllm import LLM, SamplingParams

    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    if model is None:
        cache = Path(os.environ.get("PDDLINK_CACHE", Path(tempfile.gettempdir()) / "pddlink-cache"))
        model = str(build_tiny_llama(cache / f"tiny-llama-{dtype}", TinyLlamaSpec(dtype=dtype)))
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,  # type: ignore[arg-type]
        block_size=block_size,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=prompt_tokens + tokens + 2 * block_size,
        enable_prefix_caching=True,
        seed=0,
    )
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)

    def params(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def warm(prompt: list[int], tag: str) -> None:
        engine.reset_prefix_cache()
        _stepped(engine, f"warm-{tag}", prompt, params(1))  # the prompt's blocks now in the prefix cache

    decode_s: list[float] = []
    extend_s: list[float] = []
    cached: list[int] = []
    agree = True
    warm([rng.randrange(3, vocab) for _ in range(prompt_tokens)], "first")  # compile/allocate once
    for i in range(repeats):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        warm(prompt, f"d{i}")
        _, stamps, out = _stepped(engine, f"decode-{i}", prompt, params(tokens + 1))
        decode_s.append(_first_at(stamps, tokens + 1) - _first_at(stamps, 1))
        generated = list(
            out.outputs[0].token_ids
        )  # t0 .. t_k; the k decode steps computed KV of t0 .. t_(k-1)
        warm(prompt, f"e{i}")
        t_add, stamps, ext = _stepped(engine, f"extend-{i}", prompt + generated[:tokens], params(1))
        extend_s.append(_first_at(stamps, 1) - t_add)
        cached.append(int(ext.num_cached_tokens or 0))
        agree = agree and list(ext.outputs[0].token_ids) == [generated[tokens]]
    extend_ms = statistics.median(extend_s) * 1e3
    decode_ms = statistics.median(decode_s) * 1e3
    return {
        "engine": "vllm",
        "tokens": tokens,
        f"extend_{tokens}_ms": extend_ms,
        f"decode_{tokens}_ms": decode_ms,
        "extend_speedup": decode_ms / extend_ms,
        "extend_matches_decode": agree,
        "extend_cached_prompt_tokens": min(cached),
        "extend_ms_all": [s * 1e3 for s in extend_s],
        "decode_ms_all": [s * 1e3 for s in decode_s],
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "model": model,
        "dtype": dtype,
        "block_size": block_size,
        "engine_start_s": start_s,
        "vllm_version": _vllm_version(),
    }


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@click.command(name="extend")
@click.option("--engine", type=click.Choice(["vllm"]), default="vllm", show_default=True)
@click.option(
    "--model", default=None, help="Model directory (default: the tiny random Llama, built locally)."
)
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(1, 1 << 16),
    default=1024,
    show_default=True,
    help="Prompt length (cached before each extend); a multiple of the block size caches whole blocks.",
)
@click.option("--tokens", type=click.IntRange(1, 4096), default=HANDOFF_TOKENS, show_default=True)
@click.option("--repeats", type=click.IntRange(1, 100), default=3, show_default=True)
@click.option(
    "--block-size", type=click.IntRange(1, 1024), default=32, show_default=True, help="vLLM KV block size."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def command(
    engine: str, model: str | None, dtype: str, prompt_tokens: int, tokens: int, repeats: int,
    block_size: int, as_json: bool,
) -> None:  # fmt: skip
    """Extend (prompt + N ids in one step, prompt cached) against N decode steps, on one vLLM."""
    figures = run_bench(
        model=model,
        dtype=dtype,
        prompt_tokens=prompt_tokens,
        tokens=tokens,
        repeats=repeats,
        block_size=block_size,
    )
    if as_json:
        click.echo(json.dumps(figures))
        return
    click.echo(f"vLLM {figures['vllm_version']}, {figures['model']} ({dtype}), prompt {prompt_tokens} tokens")
    click.echo(f"  extend {tokens} tokens   {figures[f'extend_{tokens}_ms']:10.1f} ms")
    click.echo(
        f"  decode {tokens} steps    {figures[f'decode_{tokens}_ms']:10.1f} ms  "
        f"(extend is {figures['extend_speedup']:.1f}x cheaper)"
    )
