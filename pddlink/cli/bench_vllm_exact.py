"""``pddlink bench vllm-exact``: PDD on vLLM (P, RelayDecode, MainDecode, a handoff in every request)
against one vLLM alone, one request at a time, float32 (see ``harness.vllm_exact``)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command(name="vllm-exact")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option("--requests", default=50, show_default=True, help="Requests per kind (greedy, seeded).")
@click.option("--max-tokens", default=200, show_default=True, help="Answer length of every request.")
def command(json_path: str | None, requests: int, max_tokens: int) -> None:
    """Greedy and seeded requests (temperature 0.8, top-p 0.95), half one-shot, half catch-up
    handoffs, each compared token for token with P's vLLM generating alone."""
    from harness.vllm_exact import ExactSpec, run

    if requests < 1 or max_tokens < 8:
        raise click.BadParameter("--requests must be >= 1 and --max-tokens >= 8")
    out = run(ExactSpec(requests=requests, max_tokens=max_tokens))
    text = json.dumps(out, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    click.echo(text)
    click.echo(
        f"{out['requests']} requests ({out['greedy']} greedy, {out['seeded']} seeded),"
        f" {out['failed']} failed, {out['handed_off']} handed off,"
        f" {out['token_mismatches']} not equal to vLLM alone",
        err=True,
    )
