"""The ``pddlink`` command.

Subcommands are loaded lazily from a name -> "module:attribute" table, so ``pddlink --help`` is fast
and a command whose optional dependency is missing fails only when it is run. Each area of the
project owns its command module under ``pddlink/cli/``; add a row here to expose a new one.
"""

from __future__ import annotations

import importlib
import sys

import click

from pddlink import __version__
from pddlink.errors import PddlinkError


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def __init__(
        self, *args: object, lazy: dict[str, tuple[str, str]] | None = None, **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            target, _ = self._lazy[cmd_name]
            module_name, attr = target.split(":")
            module = importlib.import_module(module_name)
            command = getattr(module, attr)
            if not isinstance(command, click.Command):
                raise TypeError(f"{target} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, self._lazy[name][1]) for name in sorted(self._lazy)]
        rows += [(n, c.get_short_help_str()) for n, c in self.commands.items() if n not in self._lazy]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(sorted(rows))


BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "engine": (
        "pddlink.cli.bench_engine:command",
        "Prefill, decode and extend speed of the reference engine.",
    ),
    "codec": ("pddlink.cli.bench_codec:command", "Lossless KV codec ratio and speed against plain zstd."),
    "extend": (
        "harness.vllm.bench_extend:command",
        "On vLLM: extend(100) with the prompt cached against 100 decode steps, one instance, one run.",
    ),
    "link": (
        "pddlink.cli.bench_link:command",
        "Goodput of a transport between two processes (loopback or netlab).",
    ),
    "drc": ("pddlink.cli.bench_drc:command", "Prefix match, insert rate and memory of the DRC index."),
    "wire": ("pddlink.cli.bench_wire:command", "Fuzz the frame decoder: frames/s, error types, memory."),
    "fuzz": (
        "pddlink.cli.bench_fuzz:command",
        "Fuzz the router's HTTP and gRPC request bodies with more cases than CI (source checkout).",
    ),
    "vllm": (
        "pddlink.cli.bench_vllm:command",
        "The vLLM KV connector's own cost against P's prefill and vLLM's ExampleConnector.",
    ),
    "edge": (
        "pddlink.cli.bench_edge:command",
        "A small request's first token at the router's edge against 1 MB prompts and 3,000 idle connections.",
    ),
    "vllm-exact": (
        "pddlink.cli.bench_vllm_exact:command",
        "PDD on vLLM against one vLLM alone: one at a time, float32, a handoff in every request.",
    ),
    "vllm-serve": (
        "pddlink.cli.bench_vllm_serve:command",
        "vllm bench serve (completions, chat) through the router on vLLM and straight at one vLLM.",
    ),
}

TOP_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "pddlink.cli.demo:command",
        "Run P, RLD, MD and the router across an emulated WAN; compare PDD with P->MD.",
    ),
    "chaos": (
        "pddlink.cli.chaos:command",
        "Faults under a bounded streaming load (kills, WAN outages); check the invariants.",
    ),
    "lab": (
        "pddlink.cli.lab:group",
        "The netlab WAN emulator: bring two datacenters up, run commands in them.",
    ),
    "drc": (
        "pddlink.cli.drc:group",
        "Inspect a decode-side prefix cache (running sidecar or snapshot file).",
    ),
    "sim": (
        "pddlink.cli.sim:group",
        "Cluster simulator: TTFT, goodput and benefit-cost ratio at datacenter scale.",
    ),
    "sidecar": ("pddlink.cli.sidecar:command", "Run the sidecar daemon for one role (p, rld or md)."),
    "engine": (
        "pddlink.cli.engine:command",
        "Run an engine process that attaches to its sidecar over the engine link.",
    ),
    "router": ("pddlink.cli.router:command", "Run the router: client API, pipeline policy, stream merging."),
    "pki": ("pddlink.cli.pki:group", "The dev PKI: a CA kept apart, one key and certificate per node."),
    "ping": ("pddlink.cli.diag:ping", "Ping a running sidecar: RTT, bandwidth, wire version, TLS identity."),
    "status": (
        "pddlink.cli.diag:status",
        "Pipelines, transfers, DRC and link estimates of running sidecars.",
    ),
    "drain": (
        "pddlink.cli.diag:drain",
        "Take an instance out of a running router's placement (its requests end normally).",
    ),
}


@click.group(cls=LazyGroup, lazy=BENCH_COMMANDS, name="bench")
def bench() -> None:
    """Benchmarks. Each prints figures; --json prints one JSON object on stdout."""


@click.group(cls=LazyGroup, lazy=TOP_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pddlink")
def cli() -> None:
    """pddlink: KV transport, prefix index and token-id handoff for cross-datacenter
    Prefill / RelayDecode / MainDecode inference.

    Start with `pddlink demo`.
    """


cli.add_command(bench)


def main() -> None:
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except PddlinkError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(2)
    except (OSError, RuntimeError) as exc:  # one that slipped past the command's preflight checks
        from pddlink.cli.preflight import explain

        friendly = explain(exc)
        if friendly is None:
            raise
        click.echo(f"error: {friendly.message}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
