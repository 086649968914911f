"""``pddlink bench vllm-serve``: vLLM's benchmark client against the router in front of vLLM servers
and straight at one vLLM, same run, both OpenAI backends (see ``harness.vllm_serve_bench``); with
``--topology F``, against the router over F's pools (reference engine), once per placement policy
(see ``harness.pools_serve_bench``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from harness.pools_serve_bench import PoolsBenchSpec


@click.command(name="vllm-serve")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option(
    "--topology",
    "topology_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Against the router over this topology's pools (reference engine), once per --placement.",
)
@click.option(
    "--placement",
    "placements",
    multiple=True,
    type=click.Choice(["prefix_aware", "round_robin", "prefix_hash", "least_loaded"]),
    help="With --topology: the policies to run (repeat) [prefix_aware, round_robin, prefix_hash].",
)
@click.option("--prompts", type=int, help="Requests per run [24; with --topology 96].")
@click.option("--input-len", default=256, show_default=True, help="Prompt tokens (random dataset).")
@click.option("--prefix-len", default=1024, show_default=True, help="With --topology: shared prefix tokens.")
@click.option(
    "--suffix-len", default=64, show_default=True, help="With --topology: each prompt's own tokens."
)
@click.option("--prefixes", default=12, show_default=True, help="With --topology: distinct prefixes.")
@click.option("--request-rate", default=2.0, show_default=True, help="With --topology: requests/s (Poisson).")
@click.option("--output-len", default=32, show_default=True, help="Answer tokens (--ignore-eos).")
@click.option("--concurrency", type=int, help="The client's --max-concurrency [4; with --topology 16].")
def command(
    json_path: str | None,
    topology_path: str | None,
    placements: tuple[str, ...],
    prompts: int | None,
    input_len: int,
    prefix_len: int,
    suffix_len: int,
    prefixes: int,
    request_rate: float,
    output_len: int,
    concurrency: int | None,
) -> None:
    """`vllm bench serve --backend openai` and `--backend openai-chat` through the router (P, RLD
    and MD as vLLM servers) and straight at MD's vLLM: TTFT/TPOT/ITL p50/p90/p99 and the ratios.
    With --topology: `vllm bench serve` (shared-prefix dataset) through the router over the pools,
    per placement policy, with WAN bytes per link and each MD's DRC hit."""
    if output_len < 2 or min(input_len, prompts or 1, concurrency or 1) < 1:
        raise click.BadParameter("--prompts, --input-len, --concurrency must be >= 1, --output-len >= 2")
    out: dict[str, Any]
    if topology_path:
        from harness.pools_serve_bench import POLICIES, PoolsBenchSpec

        if min(prefix_len, suffix_len, prefixes) < 1 or request_rate <= 0 or (prompts or 96) < prefixes:
            raise click.BadParameter(
                "--prefix-len, --suffix-len, --prefixes >= 1, --request-rate > 0, --prompts >= --prefixes"
            )
        pools = PoolsBenchSpec(
            prompts=prompts or 96, prefix_len=prefix_len, suffix_len=suffix_len, prefixes=prefixes,
            output_len=output_len, request_rate=request_rate, concurrency=concurrency or 16,
            policies=placements or POLICIES,
        )  # fmt: skip
        out = _pools(topology_path, pools)
        failed, total = out["errors"], out["setting"]["prompts"] * len(out["policies"])
    else:
        from harness.vllm_serve_bench import ServeBenchSpec, run, table

        spec = ServeBenchSpec(
            prompts=prompts or 24, input_len=input_len, output_len=output_len, concurrency=concurrency or 4
        )
        out = run(spec)
        click.echo(table(out), err=True)
        failed, total = out["errors"], 4 * spec.prompts
    text = json.dumps(out, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    click.echo(text)
    click.echo(f"{failed} failed requests over {total}", err=True)


def _pools(path: str, spec: PoolsBenchSpec) -> dict[str, Any]:
    from harness.pools_serve_bench import run, table
    from pddlink.errors import InvalidInput
    from pddlink.topology import load_topology

    try:
        topology = load_topology(Path(path))
    except InvalidInput as exc:
        raise click.BadParameter(str(exc), param_hint="--topology") from None
    out = run(spec, topology, path)
    click.echo(table(out), err=True)
    return out
