"""``pddlink bench vllm-serve``: vLLM's benchmark client against the router in front of vLLM servers
and straight at one vLLM, same run, both OpenAI backends (see ``harness.vllm_serve_bench``)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command(name="vllm-serve")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option("--prompts", default=24, show_default=True, help="Requests per run (4 runs).")
@click.option("--input-len", default=256, show_default=True, help="Prompt tokens (random dataset).")
@click.option("--output-len", default=32, show_default=True, help="Answer tokens (--ignore-eos).")
@click.option("--concurrency", default=4, show_default=True, help="The client's --max-concurrency.")
def command(json_path: str | None, prompts: int, input_len: int, output_len: int, concurrency: int) -> None:
    """`vllm bench serve --backend openai` and `--backend openai-chat` through the router (P, RLD
    and MD as vLLM servers) and straight at MD's vLLM: TTFT/TPOT/ITL p50/p90/p99 and the ratios."""
    from harness.vllm_serve_bench import ServeBenchSpec, run, table

    if min(prompts, input_len, concurrency) < 1 or output_len < 2:
        raise click.BadParameter("--prompts, --input-len, --concurrency must be >= 1, --output-len >= 2")
    spec = ServeBenchSpec(
        prompts=prompts, input_len=input_len, output_len=output_len, concurrency=concurrency
    )
    out = run(spec)
    text = json.dumps(out, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    click.echo(text)
    click.echo(table(out), err=True)
    click.echo(f"{out['errors']} failed requests over {4 * prompts}", err=True)
