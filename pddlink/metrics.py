"""Every Prometheus metric of pddlink, in one place.

Processes (sidecars, router) import what they update from here and serve ``render()`` on
``GET /metrics``. Metrics live in the process-wide default registry, created once at import.
Label values are small closed sets (pipeline names, paths, modes, reasons), never request ids.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0)

# --- router: requests ----------------------------------------------------------------------------
TTFT_SECONDS = Histogram(
    "pddlink_ttft_seconds",
    "Time to first token seen by the client, by pipeline",
    ["pipeline"],
    buckets=TTFT_BUCKETS_S,
)
REQUESTS = Counter("pddlink_requests", "Requests ended, by pipeline and outcome", ["pipeline", "outcome"])
REQUESTS_IN_FLIGHT = Gauge(
    "pddlink_requests_in_flight", "Requests in flight at the router, by pipeline", ["pipeline"]
)
TOKENS = Counter("pddlink_output_tokens", "Output tokens streamed to clients, by producing role", ["source"])
FALLBACKS = Counter("pddlink_fallbacks", "Fallbacks taken, by kind", ["kind"])
DECISIONS = Counter("pddlink_router_decisions", "Requests per routing option (or rejected)", ["option"])
REJECTED = Counter("pddlink_router_rejected", "Requests refused at admission, by reason", ["reason"])
CLIENT_ERRORS = Counter("pddlink_client_errors", "Malformed client requests refused, by API", ["api"])
KV_EVENTS_PUBLISHER_UP = Gauge(
    "pddlink_router_kv_events_publisher_up",
    "1 while the router's subscription to an MD vLLM's KV events (its kv_events; [vllm] md_kv_events)"
    " has a publisher connected, by MD instance",
    ["instance"],
)
HTTP_EVICTED = Counter(
    "pddlink_http_connections_evicted", "HTTP connections closed to make room (head-less or idle first)"
)
WRITES_CUT = Counter(
    "pddlink_writes_cut", "Answers cut because the client did not take them in time, by API", ["api"]
)

# --- data plane ----------------------------------------------------------------------------------
KV_BYTES = Counter("pddlink_kv_bytes", "KV bytes shipped (before any codec), by path (wan, fast)", ["path"])
KV_WIRE_BYTES = Counter(
    "pddlink_kv_wire_bytes",
    "KV payload bytes on the wire (after the codec), by path and codec",
    ["path", "codec"],
)
KV_CODEC_RAW_BYTES = Counter(
    "pddlink_kv_codec_raw_bytes",
    "KV bytes before the codec, by path and the codec they travelled in",
    ["path", "codec"],
)
HANDOFF_BYTES = Counter("pddlink_handoff_bytes", "Token-id handoff bytes on the wire")
HANDOFFS = Counter("pddlink_handoffs", "Handoffs RLD -> MD completed, by mode", ["mode"])
HANDOFF_SLICES = Counter("pddlink_handoff_slices", "Handoff slices sent, by mode", ["mode"])
TRANSFER_ABORTS = Counter(
    "pddlink_transfer_aborts", "KV transfers that ended without delivery, by reason", ["reason"]
)
TRANSFER_SECONDS = Histogram(
    "pddlink_transfer_seconds", "KV transfer duration, by path", ["path"], buckets=TTFT_BUCKETS_S
)
FAST_PATH = Gauge("pddlink_fast_path_info", "The datacenter fast path in use (1) and why", ["kind", "reason"])

# --- DRC on MD -----------------------------------------------------------------------------------
DRC_LOOKUPS = Counter("pddlink_drc_lookups", "Prefix reservations answered by MD's DRC")
DRC_LOOKUP_BLOCKS = Counter("pddlink_drc_lookup_blocks", "Prompt blocks looked up in MD's DRC")
DRC_HIT_BLOCKS = Counter("pddlink_drc_hit_blocks", "Prompt blocks found cached in MD's DRC")
DRC_CACHED_BLOCKS = Gauge("pddlink_drc_cached_blocks", "Blocks held in MD's DRC")
DRC_ENGINE_EVICTED_BLOCKS = Counter(
    "pddlink_drc_engine_evicted_blocks",
    "Blocks MD's engine dropped on its own (pool short); the DRC forgot them and what hung below",
)
DRC_EVENTS = Counter("pddlink_drc_events", "DRC change events published, by kind", ["kind"])

# --- sidecar state (sidecar.sweep) --------------------------------------------------------------
SIDECAR_HELD = Gauge(
    "pddlink_sidecar_held", "Entries a sidecar holds (requests, waiting_kv, reservations)", ["kind"]
)
SIDECAR_SWEPT = Counter(
    "pddlink_sidecar_swept", "Entries the sweep ended past their deadline, by kind", ["kind"]
)

# --- engine ----------------------------------------------------------------------------------------
ENGINE_STEP_SECONDS = Histogram(
    "pddlink_engine_step_seconds",
    "Engine call duration, by operation",
    ["op"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
ENGINE_ACTIVE = Gauge("pddlink_engine_active_requests", "Requests decoding on this engine")

# the router over pools (router.fleet)
PLACED = Counter(
    "pddlink_router_placed", "Requests placed on an instance, by role and instance", ["role", "instance"]
)
INSTANCE_OUT = Counter(
    "pddlink_router_instance_out",
    "Instances taken out of placement, by instance and why (unreachable, stalled, drained)",
    ["instance", "reason"],
)
MEMBERSHIP_STALE = Gauge(
    "pddlink_router_membership_stale",
    "1 while the router serves on its last known membership (etcd unreachable or silent), else 0",
)
MEMBERSHIP_CHANGES = Counter(
    "pddlink_router_membership_changes",
    "Membership changes from etcd the router applied (joined, left, draining, serving) or refused",
    ["change"],
)
REPLACED = Counter(
    "pddlink_router_replaced", "Requests re-placed on another MD after theirs failed before a token"
)


def render() -> tuple[bytes, str]:
    """The exposition text of every metric of this process and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def set_fast_path(kind: str, reason: str) -> None:
    FAST_PATH.clear()
    FAST_PATH.labels(kind=kind, reason=reason).set(1)
