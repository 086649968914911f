"""``pddlink bench fuzz``: the router's request-body fuzz with more cases than CI runs.

Runs the in-process fuzz tests of the router's HTTP bodies and gRPC requests
(``tests/sidecar/test_router_fuzz.py``, ``test_router_fuzz_grpc.py``) with ``--cases`` each
(CI: 100,000 each), through pytest in a subprocess; they need a source checkout and
``pddlink[dev]`` (pytest, hypothesis). Each case must end as a job or a typed refusal (400 /
``INVALID_ARGUMENT``); anything else fails the run (exit status 1) and pytest's report names the
case. ``--json`` prints one object with what the tests recorded::

    {"cases_per_api", "passed", "seconds",
     "http": {"cases", "ok", "refused", "seconds", "cases_per_s"},
     "grpc": {"cases", "ok", "refused", "undecodable", "seconds", "cases_per_s"}}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

TESTS = Path(__file__).resolve().parents[2] / "tests" / "sidecar"
FILES = ("test_router_fuzz.py", "test_router_fuzz_grpc.py")


def run_fuzz(cases: int, quiet: bool) -> tuple[int, dict[str, Any]]:
    """pytest's exit status and the counts the tests recorded."""
    missing = [f for f in FILES if not (TESTS / f).exists()]
    if missing:
        raise click.ClickException(f"needs a source checkout: {TESTS} has no {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="pddlink-fuzz-") as tmp:
        record = Path(tmp) / "fuzz.json"
        env = {**os.environ, "PDDLINK_FUZZ_CASES": str(cases), "PDDLINK_FUZZ_JSON": str(record)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-k", "in_process"]
        cmd += [str(TESTS / f) for f in FILES]
        out = subprocess.run(cmd, env=env, cwd=TESTS.parents[1], capture_output=quiet, text=True, check=False)
        figures = json.loads(record.read_text()) if record.exists() else {}
    if out.returncode and quiet:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-2000:])
    return out.returncode, figures


@click.command(name="fuzz")
@click.option(
    "--cases",
    type=click.IntRange(1, 100_000_000),
    default=1_000_000,
    show_default=True,
    help="In-process cases for each API (HTTP bodies, gRPC requests).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def command(cases: int, as_json: bool) -> None:
    """Fuzz the router's HTTP and gRPC request bodies: only jobs or typed refusals."""
    t0 = time.monotonic()
    rc, figures = run_fuzz(cases, quiet=as_json)
    result: dict[str, Any] = {
        "cases_per_api": cases,
        "passed": rc == 0,
        "seconds": round(time.monotonic() - t0, 1),
        **figures,
    }
    if as_json:
        click.echo(json.dumps(result))
    else:
        for key, value in result.items():
            click.echo(f"{key:>14}: {value}")
    if rc:
        sys.exit(1)
