"""``pddlink engine``: an engine process that attaches to its sidecar over the engine link.

The sidecar (``engine_mode = "process"``) starts this itself with the attach token in the
environment; it can also be started by hand beside a sidecar that hosts the link. It loads the
engine with ``engines_adapter.load_engine``, dials ``--sidecar``, serves commands until the sidecar
ends the link, and exits with it (with ``--die-with-parent`` also when its parent process dies).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import click

TOKEN_ENV = "PDDLINK_ENGINE_TOKEN"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no orphaned engine)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before the request took effect
            os._exit(1)


@click.command(name="engine")
@click.option(
    "--sidecar", "target", required=True, help="The sidecar's engine link: unix:/path or host:port."
)
@click.option(
    "--name", default="torch_ref", show_default=True, help="Engine adapter (engines_adapter.ENGINES)."
)
@click.option("--preset", default="tiny", show_default=True, help="Reference engine preset.")
@click.option("--dtype", default="float64", show_default=True, help="Engine dtype.")
@click.option("--block-size", type=int, default=16, show_default=True, help="KV block size in tokens.")
@click.option("--num-blocks", type=int, default=8192, show_default=True, help="KV pool size in blocks.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weight seed (reference engine).")
@click.option("--threads", type=int, default=1, show_default=True, help="torch intra-op threads.")
@click.option(
    "--prefill-slowdown",
    type=click.FloatRange(1.0, 100.0),
    default=1.0,
    show_default=True,
    help="Prefill and extend passes take this many times as long (a decode-leaning chip, emulated).",
)
@click.option(
    "--connect-timeout-s", type=float, default=30.0, show_default=True, help="Give up dialing after this."
)
@click.option("--die-with-parent", is_flag=True, help="Exit when the parent process (the sidecar) exits.")
def command(
    target: str,
    name: str,
    preset: str,
    dtype: str,
    block_size: int,
    num_blocks: int,
    seed: int,
    threads: int,
    prefill_slowdown: float,
    connect_timeout_s: float,
    die_with_parent: bool,
) -> None:
    """Run an engine process for a sidecar: load the engine, attach, serve its commands.

    The attach token comes from the PDDLINK_ENGINE_TOKEN environment variable (the sidecar sets it).
    """
    if die_with_parent:
        _die_with_parent()
    import torch

    from engines_adapter import load_engine
    from engines_adapter.link_client import serve_engine
    from pddlink.serving.malloc_trim import ENGINE_MMAP_THRESHOLD, fix_mmap_threshold, freeze_startup

    fix_mmap_threshold(ENGINE_MMAP_THRESHOLD)  # KV buffers unmapped when freed (engines_adapter.link_client)
    torch.set_num_threads(max(1, threads))
    slow = {"prefill_slowdown": prefill_slowdown} if prefill_slowdown > 1 else {}
    engine = load_engine(
        name, preset=preset, dtype=dtype, block_size=block_size, num_blocks=num_blocks, seed=seed, **slow
    )
    freeze_startup()  # the engine and its modules: the periodic collections need not walk them
    served = serve_engine(
        engine,
        target,
        os.environ.get(TOKEN_ENV, ""),
        engine_name=name,
        capacity_blocks=num_blocks,
        connect_timeout_s=connect_timeout_s,
    )
    click.echo(f"engine {os.getpid()}: link closed after {served} commands", err=True)
