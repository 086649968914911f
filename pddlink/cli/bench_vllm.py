"""``pddlink bench vllm``: the KV connector's own cost on P and MD against P's prefill time and
against vLLM's ExampleConnector, in one run (see ``harness.vllm_bench``)."""

from __future__ import annotations

import json

import click


@click.command(name="vllm")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Distinct prompts per size (median).")
def command(as_json: bool, dtype: str, repeats: int) -> None:
    """Prefill time, KV bytes and the connector's hand-out/take-in time at 512, 2048, 8192 tokens."""
    from harness.vllm_bench import run

    out = run(dtype, repeats)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    for n, r in out["sizes"].items():
        p, e = r["pddlink"], r["example"]
        click.echo(
            f"{n:>5} tokens: prefill {r['prefill_s'] * 1e3:7.1f} ms, KV {r['kv_bytes'] / 1e6:6.2f} MB"
            " | pddlink "
            f"out {p['out_s'] * 1e3:6.2f} in {p['in_s'] * 1e3:6.2f} ms ({p['overhead_of_prefill']:.1%}) | "
            f"ExampleConnector out {e['out_s'] * 1e3:6.2f} in {e['in_s'] * 1e3:6.2f} ms"
            f" ({e['overhead_of_prefill']:.1%})"
        )
