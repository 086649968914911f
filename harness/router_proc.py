"""A real router process: ``pddlink router --config FILE`` on a loopback HTTP port, its sidecars
nowhere (127.0.0.1:9, :10, :11) unless given; stopped on exit (the edge tests and
``pddlink bench edge``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cluster import ClusterError, free_port

NOWHERE = {"p": "127.0.0.1:9", "rld": "127.0.0.1:10", "md": "127.0.0.1:11"}


@dataclass(frozen=True, slots=True)
class RouterProc:
    proc: subprocess.Popen[str]
    port: int

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


@contextlib.contextmanager
def router_process(
    tmp: Path,
    api: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    vllm: dict[str, Any] | None = None,
    **top: Any,
) -> Iterator[RouterProc]:
    """``env``: the process's environment (another checkout's PYTHONPATH, to measure a baseline);
    ``vllm``: a ``[vllm]`` table (the router then fronts vLLM servers: ``engine = "vllm"``)."""
    port = free_port()
    table = {**({"engine": "vllm"} if vllm else NOWHERE), "http_port": port, "grpc_port": 0, **top}
    lines = [f"{k} = {_toml(v)}" for k, v in table.items()]
    lines += ["[api]", *(f"{k} = {_toml(v)}" for k, v in (api or {}).items())]
    if vllm:
        lines += ["[vllm]", *(f"{k} = {_toml(v)}" for k, v in vllm.items())]
    conf = tmp / f"router-{port}.toml"
    conf.write_text("\n".join(lines) + "\n")
    with router_from_config(conf, port, env=env) as router:
        yield router


@contextlib.contextmanager
def router_from_config(
    conf: Path, port: int, *, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[RouterProc]:
    """``pddlink router --config conf`` (HTTP on ``port``) until the block ends; its stderr into
    ``log`` when given (the tail of it in the error when it does not start)."""
    with open(log, "w") if log is not None else contextlib.nullcontext() as err:  # the child keeps its own
        proc = subprocess.Popen(
            [sys.executable, "-m", "pddlink.cli.main", "router", "--config", str(conf)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            tail = log.read_text()[-2000:] if log is not None else line
            raise ClusterError(f"router did not start: {tail!r}")
        yield RouterProc(proc, port)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
