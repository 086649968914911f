"""``pddlink bench edge``: a small request's first token at the router's HTTP edge, alone against
four 1 MB prompts or 3,000 idle connections from other clients (see ``harness.edge_bench``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command(name="edge")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option("--rounds", default=21, show_default=True, help="Requests per figure (alone and loaded each).")
def command(json_path: str | None, rounds: int) -> None:
    """Ratios to the unloaded time in the same run: four 1 MB prompts in flight (target <= 1.2x),
    3,000 idle connections held (target <= 1.5x, open files under the cap + 64). Exit 1 when a
    target is missed."""
    from harness.edge_bench import run

    if rounds < 3:
        raise click.BadParameter("--rounds must be >= 3")
    out = run(rounds=rounds, say=lambda line: click.echo(line, err=True))
    text = json.dumps(out, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    click.echo(text)
    h, i = out["heavy_1mb"], out["idle_flood"]
    click.echo(
        f"edge: four 1 MB prompts {h['loaded_ms']} ms vs {h['alone_ms']} ms alone ({h['ratio']}x, target"
        f" <= 1.2x); 3000 idle connections {i['loaded_ms']} ms vs {i['alone_ms']} ms ({i['ratio']}x, target"
        f" <= 1.5x), open files {i['open_files_flooded']} (cap + 64 = {i['open_files_cap']})",
        err=True,
    )
    sys.exit(0 if out["ok"] else 1)
