"""A vLLM sidecar as users run it: ``pddlink sidecar --config F`` in a process of its own, with the
file written from a few fields. What the tests and demos read of it comes over its admin socket
(``/status``, ``/transfers``), as an operator's tools would; ``kill()`` is ``kill -9``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pddlink.errors import DeadlineExceeded, Unavailable
from pddlink.serving.http import fetch


def sidecar_toml(role: str, name: str, workdir: Path, model_id: str, block_size: int, **keys: Any) -> str:
    """A sidecar file with ``engine = "vllm"``; ``keys``: ``kv_port``, ``md_kv``, ``rld_kv``,
    ``topology`` (P: a topology file whose MDs and RLDs are its peers by name), ``kv_events_endpoint``,
    ``orphan_s``, ``wan_line_mbit``, ``fast_transport``, ``region_bytes``."""
    top = [
        'engine = "vllm"',
        f'role = "{role}"',
        f'peer_id = "{name}"',
        'host = "127.0.0.1"',
        f"kv_port = {int(keys.get('kv_port', 0))}",
        f'admin_unix = "{workdir / f"{name}.admin.sock"}"',
    ]
    vllm = [
        "[vllm]",
        f'model_id = "{model_id}"',
        f"block_size = {block_size}",
        f'workdir = "{workdir}"',
        f"region_bytes = {int(keys.get('region_bytes', 256 << 20))}",
        f"orphan_s = {float(keys.get('orphan_s', 120.0))}",
    ]
    if keys.get("kv_events_endpoint"):
        vllm.append(f'kv_events_endpoint = "{keys["kv_events_endpoint"]}"')
    plane = [
        "[data_plane]",
        f'fast_transport = "{keys.get("fast_transport", "auto")}"',
        f"wan_line_mbit = {float(keys.get('wan_line_mbit', 0.0))}",
    ]
    peers = ["[peers]"] + [f'{k} = "{keys[k]}"' for k in ("md_kv", "rld_kv", "topology") if keys.get(k)]
    return "\n".join([*top, *vllm, *plane, *peers]) + "\n"


class SidecarProcess:
    """One ``pddlink sidecar`` beside one vLLM server."""

    def __init__(self, workdir: Path, name: str, config: str) -> None:
        self.workdir, self.name = workdir, name
        self.config_path = workdir / f"{name}.toml"
        self.config_path.write_text(config)
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}

    @property
    def admin(self) -> str:
        return f"unix:{self.workdir / f'{self.name}.admin.sock'}"

    @property
    def control_path(self) -> Path:
        return Path(self.ready["control_socket"])

    @property
    def kv_port(self) -> int:
        return int(self.ready["kv_port"])

    def start(self, timeout_s: float = 120.0) -> SidecarProcess:
        log = open(self.workdir / f"{self.name}.log", "a")  # noqa: SIM115 (the child holds it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pddlink", "sidecar", "--config", str(self.config_path)],
            stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )  # fmt: skip
        log.close()
        got: list[str] = []
        proc = self.proc

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not got and line.startswith("READY "):
                    got.append(line)
            # the rest is drained so the child never blocks on a full pipe

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not got:
            if proc.poll() is not None:
                raise Unavailable(f"sidecar {self.name} exited {proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise DeadlineExceeded(
                    f"sidecar {self.name} not ready in {timeout_s:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.02)
        self.ready = json.loads(got[0][6:])
        return self

    def get(self, path: str) -> Any:
        status, body = fetch(self.admin, "GET", path, timeout_s=10.0)
        if status != 200:
            raise Unavailable(f"sidecar {self.name} {path}: HTTP {status} {body[:200]!r}")
        return json.loads(body)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("/status")
        return out

    def transfers(self) -> dict[str, Any]:
        """P: ``done`` (each finished transfer's record); RLD/MD: ``finished`` (vLLM's own hit at each
        request's end), ``in_flight`` (transfers held), ``leases`` (DRC reservations)."""
        out: dict[str, Any] = self.get("/transfers")
        return out

    def log_tail(self, lines: int = 8) -> str:
        with contextlib.suppress(OSError):
            return " | ".join((self.workdir / f"{self.name}.log").read_text().splitlines()[-lines:])
        return ""

    def kill(self) -> None:
        """``kill -9``: nothing of it runs its cleanup."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def close(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
