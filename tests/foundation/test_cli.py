"""Every command in the CLI's lazy table imports and answers --help."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from pddlink.cli.main import BENCH_COMMANDS, TOP_COMMANDS, cli


@pytest.mark.parametrize("name", sorted(TOP_COMMANDS))
def test_top_command_help(name: str) -> None:
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


@pytest.mark.parametrize("name", sorted(BENCH_COMMANDS))
def test_bench_command_help(name: str) -> None:
    result = CliRunner().invoke(cli, ["bench", name, "--help"])
    assert result.exit_code == 0, result.output
    assert "--json" in result.output


def test_top_level_help_lists_commands_without_importing_them() -> None:
    code = (
        "import sys\n"
        "from pddlink.cli.main import cli\n"
        "try:\n    cli(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'top-level help imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in TOP_COMMANDS:
        assert name in out.stdout


def test_unknown_command_fails_cleanly() -> None:
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code != 0
    assert "No such command" in result.output
