"""The reference of every TOML key of the sidecar and the router, generated from their config
dataclasses (``SidecarConfig`` and its sections, ``RouterConfig``, the router's serving keys and
``ApiConfig``). Types and defaults come from the dataclasses; meanings from ``MEANINGS`` below.
A test regenerates ``docs/config-reference.md`` and fails when a dataclass gains a key without a
meaning or the committed page is stale: ``python -m harness.config_reference > docs/config-reference.md``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from pddlink.membership.config import MembershipConfig
from pddlink.serving.client_guard import ApiConfig
from router import RouterConfig, VllmEngineConfig
from sidecar.config import DataPlaneConfig, DecodeConfig, EngineConfig, PeersConfig, SidecarConfig
from sidecar.config import VllmConfig as SidecarVllmConfig

MEANINGS: dict[str, str] = {
    # sidecar, top level
    "sidecar.role": "p (prefill), rld (RelayDecode) or md (MainDecode); required",
    "sidecar.peer_id": "this sidecar's instance name; its identity is role/peer_id ('' = <role>0)",
    "sidecar.host": "address the sidecar binds (gRPC, KV, admin)",
    "sidecar.grpc_port": "router- and peer-facing gRPC port (0: any free port, printed in READY)",
    "sidecar.kv_port": "KV transport server port (RLD and MD; 0: any free port)",
    "sidecar.admin_port": "admin HTTP port: /metrics, /healthz, /status (0: off)",
    "sidecar.admin_unix": "also serve the admin HTTP on this unix socket ('' = off)",
    "sidecar.tls_dir": "dev PKI directory: mutual TLS 1.3 on gRPC and the KV data plane ('' = plaintext)",
    "sidecar.admin_keys_file": "bearer keys for admin_port, one per line; all but /healthz and /readyz"
    " need one there (the unix socket needs none); '' = no key, refused on a non-loopback host",
    "sidecar.allow_plaintext_non_loopback": "allow tls_dir = '' on a non-loopback host (an explicit choice)",
    "sidecar.allow_unauthenticated_non_loopback": "allow admin_port without admin_keys_file on a"
    " non-loopback host (an explicit choice)",
    "sidecar.engine_kind": 'the engine beside this sidecar, written `engine = "reference"` or'
    ' `engine = "vllm"` at the top level (an [engine] table means the reference engine)',
    "sidecar.engine": "the [engine] table (the reference engine)",
    "sidecar.vllm": 'the [vllm] table (engine = "vllm")',
    # [vllm] of a sidecar beside vLLM
    "sidecar_vllm.model_id": "namespace of the block hashes: the same string on P, RLD and MD; required",
    "sidecar_vllm.block_size": "vLLM's --block-size (printed by --print-vllm-args)",
    "sidecar_vllm.workdir": "directory of the connector's control socket <workdir>/<peer_id>.sock"
    " (shared with vLLM)",
    "sidecar_vllm.region_bytes": "size of the shared-memory region the KV moves through",
    "sidecar_vllm.region_dir": "where the region lives ('' = /dev/shm where it has room, else workdir)",
    "sidecar_vllm.kv_events_endpoint": "RLD/MD: vLLM's KV-cache event publisher the DRC follows (ipc:// or"
    " tcp://; '' = no DRC feed)",
    "sidecar_vllm.orphan_s": "RLD/MD: a landed transfer no request loads is freed after this long",
    "sidecar_vllm.max_model_len": "printed as vLLM's --max-model-len (0: vLLM's default)",
    "sidecar.peers": "the [peers] table",
    "sidecar.data_plane": "the [data_plane] table",
    "sidecar.decode": "the [decode] table",
    # [engine]
    "engine.name": "engine adapter: torch_ref (the reference engine) or hf",
    "engine.preset": "reference engine model preset (tiny, small, ...)",
    "engine.dtype": "engine dtype; float64 makes token comparisons exact",
    "engine.block_size": "tokens per KV block",
    "engine.num_blocks": "KV pool size in blocks",
    "engine.seed": "weight seed of the reference engine (every role must use the same)",
    "engine.mode": "thread: a thread of the sidecar; process: a child `pddlink engine` over the engine link",
    "engine.prefill_slowdown": (
        "reference engine: prefill and extend passes take this many times as long (a decode-leaning chip, "
        "emulated; 1: none)"
    ),
    "engine.call_timeout_s": "process mode: deadline of every engine command",
    "engine.attach_timeout_s": "process mode: deadline for the engine child to attach",
    # [peers]
    "peers.md_grpc": "MD's gRPC address host:port as this sidecar reaches it (P, RLD; across the WAN)",
    "peers.md_kv": "MD's KV address host:port (P)",
    "peers.rld_grpc": "RLD's gRPC address host:port (P)",
    "peers.rld_kv": "RLD's KV address host:port (P)",
    "peers.topology": "a topology file (docs/topology.md; relative to this file): every MD and RLD in it"
    " with a kv address is a peer by identity (beside vLLM: by instance name), so the router may place a"
    " request on any of them",
    "peers.md_identity": "who must answer at md_* (checked against its TLS certificate)",
    "peers.rld_identity": "who must answer at rld_* (checked against its TLS certificate)",
    # [data_plane]
    "data_plane.wan_transport": "KV transport across the WAN: tcp or quic",
    "data_plane.fast_transport": "KV transport P -> RLD: tcp, quic, rdma or auto (rdma if a device exists)",
    "data_plane.wan_streams": "striped connections per WAN link",
    "data_plane.wan_links": "links in the WAN connection pool (a transfer takes the least loaded)",
    "data_plane.chunk_bytes": "KV chunk size on the wire",
    "data_plane.reserve_lease_s": "how long MD holds a reserved prefix for P's transfer",
    "data_plane.wan_codec": "KV codec: auto (compress if the line is slower than it), raw or planes_zstd",
    "data_plane.wan_line_mbit": "WAN line rate for the codec choice (0: unknown, measured from transfers)",
    # [decode]
    "decode.max_batch": "requests decoded in one engine step",
    "decode.capacity": "requests at which the load counts as 1.0 (routing and handoff mode)",
    "decode.catch_up_below_load": "RLD hands over by catch-up below this load, one-shot above",
    "decode.slice_tokens": "tokens per catch-up handoff slice",
    # router, top level
    "router.p": "P sidecar's gRPC address host:port; required with engine reference",
    "router.rld": "RLD sidecar's gRPC address host:port; required with engine reference",
    "router.md": "MD sidecar's gRPC address host:port (across the WAN); required with engine reference",
    "router.engine": "reference (the sidecars p, rld, md over gRPC) or vllm (the [vllm] table's servers)",
    "router.vllm": "the [vllm] table: the roles as vLLM OpenAI servers (engine vllm)",
    "router.relay_enabled": "use RelayDecode at all (false: the cross-datacenter P->MD baseline)",
    "router.relay_min_wan_s": "relay through RLD when the WAN estimate for the missing KV is longer",
    "router.rld_capacity": "requests at which RLD's load is 1.0",
    "router.rld_max_load": "no new relay above this RLD load",
    "router.rld_token_budget": "no new relay while RLD produced this share of the recent requests' output"
    " tokens (1: no budget)",
    "router.rld_tpot_s": "RLD's time per output token, for the singular test",
    "router.singular_max_tokens": "only outputs this short may end on RLD (singular pipeline)",
    "router.line_mbit": "WAN line rate for the link model until transfers measure it",
    "router.rtt_ms": "WAN round-trip time for the link model",
    "router.deadline_s": "default request deadline",
    "router.max_tokens_limit": "largest max_tokens a request may ask for",
    "router.max_prompt_tokens": "largest prompt in tokens",
    "router.vocab_size": "model vocabulary: prompt and stop token ids must be below it",
    "router.kv_bytes_per_token": "KV bytes per token of the model (link model)",
    "router.wan_links": "links in P's WAN pool (the link model's pool size)",
    "router.recompute": "MD may prefill the missing suffix itself instead of receiving its KV",
    "router.admission": "refuse at once (503 / RESOURCE_EXHAUSTED) what no option ends before its deadline",
    "router.p_prefill_tokens_per_s": "P's prefill speed to start from (the replies refine it)",
    "router.md_prefill_tokens_per_s": "MD's prefill speed to start from",
    "router.md_tpot_s": "MD's time per output token, for deadlines",
    "router.slo_ttft_ms": "the SLO's time to first token: no option that misses it is taken; a request"
    " none meets is refused at once (0: no bound)",
    "router.slo_tpot_ms": "the SLO's time per output token: recompute on MD only while it keeps this"
    " request's and MD's running requests' TPOT within it; a request none meets is refused at once"
    " (0: no bound)",
    "router.tls_dir": "dev PKI directory: mutual TLS 1.3 to the sidecars and on grpc_port ('' = plaintext)",
    "router.name": "this router's instance name; its identity is router/name",
    "router.p_identity": "who must answer at p (checked against its certificate)",
    "router.rld_identity": "who must answer at rld",
    "router.md_identity": "who must answer at md",
    "router.topology": "the deployment as pools: a [topology] table, or the path of a TOML file holding one"
    " (relative to this file; docs/topology.md); instead of p, rld and md (engine vllm: instead of"
    " [vllm]'s p_url, md_url, rld_url and md_kv_events)",
    "router.placement": "which MD (and P, RLD) serves a request: prefix_aware (each MD's own DRC mirror,"
    " its link's backlog, load), round_robin, least_loaded or prefix_hash (no events)",
    "router.membership": "[membership]: instances that announce themselves in etcd join the topology's"
    " datacenters (docs/topology.md); needs tls_dir",
    "sidecar.membership": "[membership]: announce this sidecar in etcd (P and RLD also take announced MDs"
    " and RLDs as peers; docs/topology.md); needs tls_dir",
    # [membership], sidecar and router
    "membership.etcd": "etcd's client endpoints, host:port[,host:port] ('' = off: the topology file alone)",
    "membership.cluster": "the cluster name: keys under <prefix>/<cluster>/members/<role>/<name>",
    "membership.prefix": "the keys' prefix",
    "membership.datacenter": "sidecar: the datacenter it announces (one of the routers' topology); required"
    " there, refused in a router's file",
    "membership.ttl_s": "sidecar: its lease in whole seconds; a killed sidecar leaves after this"
    " (router: refused)",
    "membership.request_timeout_s": "the longest any one etcd call may take",
    "router.host": "address the router binds (gRPC and HTTP)",
    "router.grpc_port": "gRPC port of the Router service (0: any free port)",
    "router.http_port": "HTTP port of the OpenAI-compatible API (0: off)",
    "router.allow_plaintext_non_loopback": "allow tls_dir = '' on a non-loopback host (an explicit choice)",
    "router.allow_unauthenticated_non_loopback": "allow http_port without [api] api_keys_file or http_mtls"
    " on a non-loopback host (an explicit choice)",
    "router.unix": "also serve HTTP on this unix socket and gRPC on <path>.grpc (local, keyless, mode 0600)",
    # router [vllm]
    "vllm.p_url": "P's vLLM OpenAI server, http://host:port (its PddlinkConnector a kv_producer); p_url,"
    " md_url, rld_url and md_kv_events name one server each, never beside a topology (whose instances"
    " name their api_url and kv_events)",
    "vllm.md_url": "MD's vLLM OpenAI server across the WAN (kv_consumer)",
    "vllm.rld_url": "RLD's vLLM OpenAI server beside P ('' = no RelayDecode: P->MD only)",
    "vllm.model": "the model name the vLLM servers serve (sent as the body's model)",
    "vllm.wan_share": "time share P's transfer to MD may take (MD then reports a miss in time)",
    "vllm.rld_gets_kv": "P ships the prompt's KV to RLD over the fast path (else RLD prefills it itself)",
    "vllm.api_key_file": "file holding the key the vLLM servers were started with (--api-key or"
    " VLLM_API_KEY), sent as a bearer token ('' = none)",
    "vllm.md_kv_events": "MD vLLM's KV-event publisher (its --kv-events-config endpoint): the router's DRC"
    " mirror subscribes beside MD's sidecar ('' = no mirror: the router sees no prefix on MD)",
    # router [api]
    "api.model": "model name that /v1/models lists and requests may name",
    "api.tokenizer": "model directory with tokenizer.json (and a chat template): text prompts and text out",
    "api.api_keys_file": "file of bearer API keys, one per line ('#' comments); '' = no key required",
    "api.http_mtls": "HTTP port takes TLS 1.3 with a client certificate of tls_dir's CA",
    "api.max_body_bytes": "request bodies above this get 413, checked while reading",
    "api.body_budget_bytes": "request body bytes buffered at once over all connections (503 beyond)",
    "api.header_timeout_s": "the whole request head must arrive within this",
    "api.body_timeout_s": "the whole request body must arrive within this (408 after)",
    "api.idle_timeout_s": "a keep-alive connection without a request closes after this",
    "api.stop_notice_s": "after SIGTERM, how long requests on connections opened before are still answered"
    " (the load balancer's health checks take the router out meanwhile); 0 = refuse at once",
    "api.first_byte_timeout_s": "a new connection that sends no byte closes after this (or idle_timeout_s,"
    " if shorter); head-less connections are also the first closed to make room at the caps",
    "api.write_stall_s": "an answer whose client takes none of its bytes this long is cut (its request"
    " cancelled); every answer is cut at its deadline + 0.5 s",
    "api.send_buffer_bytes": "each HTTP connection's kernel send buffer (SO_SNDBUF): what an unread"
    " answer pins",
    "api.max_connections": "open HTTP client connections over all clients; at the cap the oldest"
    " head-less (then idle) connection is closed for a new one, and only when all are busy is it"
    " refused (503, at once)",
    "api.max_connections_per_client": "open HTTP connections per client: its API key once a request head"
    " names one, else its address (429 beyond; strangers' head-less connections go first)",
    "api.max_concurrent_requests": "requests generating at once, HTTP and gRPC (503 + Retry-After beyond)",
    "api.rate_per_client_s": "requests per second per client, token bucket (429 + Retry-After; 0 = off)",
    "api.rate_burst": "the token bucket's size",
    "api.retry_after_s": "Retry-After that a 503 tells the client",
    "api.tokenizer_workers": "threads that tokenize large text prompts (and detokenize), off the event loop",
    "api.parse_processes": "worker processes that parse and tokenize request bodies over 64 kB, so the"
    " GIL they hold is not the router's; over plaintext HTTP they also receive such a body from the"
    " client's socket, so the router's event loop never does (docs/api.md; a dead one: its request"
    " gets 503 and it is replaced); 0 = on the tokenizer_workers threads, the router receiving"
    " every body",
    "api.max_prompt_bytes": "a text prompt's UTF-8 bytes, checked before tokenizing (400 beyond);"
    " 0 = max_prompt_tokens x the tokenizer's longest token in bytes (no prompt within the token"
    " limit is refused)",
}

ROUTER_SERVING = [
    ("host", "str", "127.0.0.1"),
    ("grpc_port", "int", 0),
    ("http_port", "int", 0),
    ("unix", "str", ""),
    ("allow_plaintext_non_loopback", "bool", False),
    ("allow_unauthenticated_non_loopback", "bool", False),
]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return "(table)"
    return "(required)"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value not in ("(required)", "(table)"):
        return f'"{value}"'
    return str(value)


def rows(prefix: str, cls: type[Any]) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of each field; KeyError names a field without a meaning."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        out.append((f.name, str(f.type), _toml(_default(f)), MEANINGS[key]))
    return out


def missing() -> list[str]:
    """Config keys that have no meaning in ``MEANINGS`` (the test's list of what to document)."""
    gaps = []
    for prefix, cls in TABLES:
        gaps += [
            f"{prefix}.{f.name}" for f in dataclasses.fields(cls) if f"{prefix}.{f.name}" not in MEANINGS
        ]
    return gaps


TABLES: list[tuple[str, type[Any]]] = [
    ("sidecar", SidecarConfig),
    ("engine", EngineConfig),
    ("peers", PeersConfig),
    ("data_plane", DataPlaneConfig),
    ("decode", DecodeConfig),
    ("sidecar_vllm", SidecarVllmConfig),
    ("router", RouterConfig),
    ("vllm", VllmEngineConfig),
    ("api", ApiConfig),
    ("membership", MembershipConfig),
]

TITLES = {
    "sidecar": "## Sidecar (`pddlink sidecar --config FILE`): top level",
    "engine": "### `[engine]`",
    "peers": "### `[peers]`",
    "data_plane": "### `[data_plane]`",
    "decode": "### `[decode]`",
    "sidecar_vllm": '### `[vllm]` of a sidecar beside vLLM (`engine = "vllm"`)',
    "router": "## Router (`pddlink router --config FILE`): top level",
    "vllm": '### `[vllm]`: the roles as vLLM servers (`engine = "vllm"`)',
    "api": "### `[api]`: the client API",
    "membership": "## `[membership]` of a sidecar or a router: membership through etcd",
}


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Every TOML key of `pddlink sidecar` and `pddlink router`, generated from the config dataclasses",
        "(`sidecar/config.py`, `router/config.py`, `pddlink/serving/client_guard.py`) by",
        "`python -m harness.config_reference > docs/config-reference.md`; a test keeps it in sync.",
        "Command-line flags override the file's keys of the same name (`--grpc-port` for `grpc_port`).",
        "Unknown keys are refused.",
        "",
    ]
    for prefix, cls in TABLES:
        lines += [TITLES[prefix], "", "| key | type | default | meaning |", "|---|---|---|---|"]
        table = rows(prefix, cls)
        if prefix == "router":
            table += [(k, t, _toml(d), MEANINGS[f"router.{k}"]) for k, t, d in ROUTER_SERVING]
        lines += [f"| `{k}` | {t} | `{d}` | {m} |" for k, t, d, m in table]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
