"""``pddlink drc stats|match|snapshot``: inspect a decode-side prefix cache.

The source is either a running MD sidecar (``--url http://HOST:PORT``, its admin HTTP endpoints
GET /drc/stats, POST /drc/match, GET /drc/snapshot) or a snapshot file saved by ``pddlink drc
snapshot``. Against a file the answers are computed here with the same functions the sidecar uses
(``pddlink.drc.inspect``); a file records no hit statistics or recency, only the cached blocks.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from pddlink.drc import Snapshot, decode_snapshot
from pddlink.drc.inspect import match_json, parse_match_request, stats_json
from pddlink.errors import InvalidInput, RemoteError, Unavailable
from pddlink.kv.hashing import BlockHasher

_SOURCE = [
    click.option("--url", help="Admin HTTP address of a running MD sidecar, e.g. http://127.0.0.1:9100."),
    click.option(
        "--snapshot", "snapshot_path", type=click.Path(dir_okay=False, path_type=Path), help="Snapshot file."
    ),
    click.option("--timeout-s", default=10.0, show_default=True, help="HTTP timeout."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout."),
]


def source_options(fn: Any) -> Any:
    for option in reversed(_SOURCE):
        fn = option(fn)
    return fn


def http(url: str, path: str, timeout_s: float, body: object = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, method="GET" if body is None else "POST"
    )
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return bytes(reply.read())
    except urllib.error.HTTPError as exc:
        raise RemoteError(
            f"{url}{path}: HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        ) from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise Unavailable(f"cannot reach {url}{path}: {exc}") from None


def load_snapshot(path: Path) -> Snapshot:
    try:
        return decode_snapshot(path.read_bytes())
    except OSError as exc:
        raise InvalidInput(f"cannot read snapshot {path}: {exc}") from None


def one_source(url: str | None, snapshot_path: Path | None) -> None:
    if (url is None) == (snapshot_path is None):
        raise click.UsageError("give exactly one of --url and --snapshot")


def show(answer: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(answer))
        return
    for key, value in answer.items():
        if key == "top_prefixes":
            click.echo("top prefixes (blocks, sequences below, tip):")
            for row in value:
                click.echo(f"  {row['blocks']:>8} {row['sequences']:>8}  {row['tip']}")
        else:
            click.echo(f"{key}: {value}")


@click.group(name="drc")
def group() -> None:
    """Inspect a decode-side prefix cache (running sidecar or snapshot file)."""


@group.command()
@source_options
@click.option("--top", default=5, show_default=True, help="How many most-shared prefixes to list.")
def stats(url: str | None, snapshot_path: Path | None, timeout_s: float, as_json: bool, top: int) -> None:
    """Cached blocks, hit rate, evictions, reservations and the most shared prefixes."""
    one_source(url, snapshot_path)
    if url is not None:
        answer = json.loads(http(url, "/drc/stats", timeout_s))
    else:
        assert snapshot_path is not None
        snap = load_snapshot(snapshot_path)
        answer = stats_json(snap.to_index(), top=top, block_size=snap.block_size or None)
        answer["source"] = str(snapshot_path)
    show(answer, as_json)


def read_tokens(tokens: str | None, tokens_file: Path | None) -> list[int]:
    if (tokens is None) == (tokens_file is None):
        raise click.UsageError("give exactly one of --tokens and --tokens-file")
    text = tokens if tokens is not None else tokens_file.read_text()  # type: ignore[union-attr]
    try:
        value = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [int(t) for t in text.replace(",", " ").split()]
        )
    except ValueError as exc:
        raise InvalidInput(f"token ids must be a JSON list or comma/space separated ints: {exc}") from None
    return parse_match_request({"tokens": value})


def snapshot_hasher(snap: Snapshot, model: str | None, block_size: int | None, salt: str) -> BlockHasher:
    size = block_size or snap.block_size
    if not size:
        raise InvalidInput("the snapshot does not record its block size: pass --block-size")
    if model is None:
        if not snap.root:
            raise InvalidInput("the snapshot does not record its hash root: pass --model")
        return BlockHasher("(from snapshot root)", size)
    hasher = BlockHasher(model, size, tenant_salt=salt)
    if snap.root and hasher.root != snap.root:
        raise InvalidInput("this model, tenant salt and block size do not hash like the snapshot")
    return hasher


@group.command()
@source_options
@click.option("--tokens", help="Prompt token ids: a JSON list or comma/space separated ints.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="Model id (snapshot only; default: the snapshot's recorded hash root).")
@click.option("--block-size", type=int, help="Tokens per block (snapshot only; default: recorded).")
@click.option("--tenant-salt", default="", help="Tenant salt (snapshot only).")
def match(
    url: str | None,
    snapshot_path: Path | None,
    timeout_s: float,
    as_json: bool,
    tokens: str | None,
    tokens_file: Path | None,
    model: str | None,
    block_size: int | None,
    tenant_salt: str,
) -> None:
    """How much of a prompt's prefix is cached (read-only: changes no statistics or recency)."""
    one_source(url, snapshot_path)
    ids = read_tokens(tokens, tokens_file)
    if url is not None:
        answer = json.loads(http(url, "/drc/match", timeout_s, {"tokens": ids}))
    else:
        assert snapshot_path is not None
        snap = load_snapshot(snapshot_path)
        hasher = snapshot_hasher(snap, model, block_size, tenant_salt)
        parent = snap.root if model is None else None
        answer = match_json(snap.to_index(), hasher, {"tokens": ids}, parent=parent)
    show(answer, as_json)


@group.command()
@click.option("--url", required=True, help="Admin HTTP address of a running MD sidecar.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--timeout-s", default=30.0, show_default=True)
def snapshot(url: str, output: Path, timeout_s: float) -> None:
    """Save a running sidecar's index (GET /drc/snapshot) to a file."""
    from pddlink.cli.preflight import check_output_file

    check_output_file(str(output), "drc snapshot -o")
    data = http(url, "/drc/snapshot", timeout_s)
    snap = decode_snapshot(data)  # refuse to save something that is not a snapshot
    output.write_bytes(data)
    click.echo(f"saved {len(snap.hashes)} blocks (epoch {snap.epoch}, seq {snap.seq}) to {output}", err=True)
