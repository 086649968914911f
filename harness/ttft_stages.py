"""Where TTFT goes in the vLLM demo's PDD phase (``pddlink demo --engine vllm``): the stage table.

Pure functions of what the demo recorded; nothing here starts or reads a server. The path of a
request's first token (PDD: P prefills, its sidecar ships the KV to RLD over the fast path, RLD
loads it and decodes; a request whose first token came from MD: the WAN leg and MD instead) is
cut into stages, each from the clock that sees it:

  router_admission_placement  the router's own stamps (trace ``stamps_s.sent``): the request's
                              checks, admission, placement and run set-up until its calls (P's
                              among them) go out; per request
  p_queue                     P's vLLM: queued -> scheduled (``vllm:request_queue_time_seconds``)
  prefill                     P's vLLM: scheduled -> first token (``vllm:request_prefill_time_seconds``)
                              less kv_copy_out, which runs inside that step
  kv_copy_out                 P's connector, steps that saved (hook timing records: ALLOC's answer,
                              the copy into the sidecar's region, COMMIT)
  transfer_fast_path /        P's sidecar, the leg that fed the first token: from COMMIT to the
  transfer_wan                destination's ack (``ship_seconds`` in P's /transfers record); per request
  consumer_load               the consumer's connector, steps that loaded (hook timing records)
  first_decode                the consumer's vLLM: scheduled (its KV loaded) -> first token (the
                              prompt's tail, < 1 block, recomputed, and the first token sampled)
  first_byte                  the router: its run's first token -> the client has it; per request

Each value is a median: over the requests in scope where the record is per request; over the whole
phase's histogram (Prometheus-style interpolation inside a bucket; the demo gives vLLM 1 ms buckets
up to 50 ms, so a stage under 1 ms reads as a share of the first) or hook records where vLLM or the
connector keeps no request id. ``residual_s`` is the median TTFT
less their sum: the waits between stages that no clock here splits (HTTP into and out of each
vLLM, a landing noticed at the consumer's next step, the consumer waiting for a step, the SSE to
the router). ``router_ttft_share``: the median of the router's own time per request (admission and
placement, plus first byte) over the median TTFT, both over every request of the phase.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
# vLLM's default request-latency buckets start at 0.3 s; these resolve the stages (tens of ms)
LATENCY_BUCKETS_S = (
    [round(0.001 * i, 3) for i in range(1, 51)]
    + [round(0.05 + 0.005 * i, 3) for i in range(1, 51)]
    + [0.35, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0]
)
VLLM_ARGS = ("--custom-histogram-buckets", json.dumps({"request_latency": LATENCY_BUCKETS_S}))

_BUCKET = re.compile(r'^(\S+?)_bucket\{[^}]*le="([^"]+)"[^}]*\} ([0-9.e+-]+)$', re.M)


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative counts per upper bound (the last bound is +Inf), summed over label sets."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @classmethod
    def parse(cls, metrics_text: str, name: str) -> Histogram:
        by_le: dict[float, float] = {}
        for metric, le, value in _BUCKET.findall(metrics_text):
            if metric == name:
                by_le[float(le)] = by_le.get(float(le), 0.0) + float(value)
        bounds = tuple(sorted(by_le))
        return cls(bounds, tuple(by_le[b] for b in bounds))

    def minus(self, earlier: Histogram) -> Histogram:
        """What was observed since ``earlier`` (same bounds; an empty earlier one counts 0)."""
        before = dict(zip(earlier.bounds, earlier.counts, strict=True))
        return Histogram(
            self.bounds, tuple(c - before.get(b, 0.0) for b, c in zip(self.bounds, self.counts, strict=True))
        )

    def quantile(self, q: float) -> float | None:
        """As Prometheus' ``histogram_quantile``: linear inside the bucket the rank falls in."""
        if not self.counts or self.counts[-1] <= 0:
            return None
        rank = q * self.counts[-1]
        lower_b, lower_c = 0.0, 0.0
        for b, c in zip(self.bounds, self.counts, strict=True):
            if c >= rank and c > lower_c:
                if b == float("inf"):
                    return lower_b
                return lower_b + (b - lower_b) * (rank - lower_c) / (c - lower_c)
            lower_b, lower_c = b, c
        return lower_b


def median_between(before: str, after: str, name: str) -> float | None:
    """The median of histogram ``name`` over what a server observed between two /metrics texts."""
    return Histogram.parse(after, name).minus(Histogram.parse(before, name)).quantile(0.5)


def hook_median(lines: Iterable[str], op: str) -> float | None:
    """The median hook time (``seconds``) of the connector's worker steps marked ``op`` ("save" or
    "load"; ``engines_adapter.vllm.hook_timing``)."""
    xs = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a blank line, or one the connector was still writing
        if op in str(rec.get("op", "")).split("+"):
            xs.append(float(rec["seconds"]))
    return statistics.median(xs) if xs else None


@dataclass(frozen=True, slots=True)
class EngineSide:
    """The vLLM-side medians of a phase: P's, and each consumer's (by role: "rld", "md")."""

    p_queue_s: float | None = None
    p_prefill_step_s: float | None = None  # scheduled -> first token, the copy-out inside
    kv_copy_out_s: float | None = None
    load_s: dict[str, float | None] | None = None
    first_decode_s: dict[str, float | None] | None = None
    consumer_queue_s: dict[str, float | None] | None = None  # queued -> scheduled: waits for its KV

    @classmethod
    def of(cls, metrics: dict[str, tuple[str, str]], hooks: dict[str, list[str]]) -> EngineSide:
        """From each server's /metrics text before and after the phase and its connector's hook
        records in between, by role ("p", "rld", "md")."""
        p = metrics.get("p", ("", ""))
        consumers = [r for r in metrics if r != "p"]
        return cls(
            p_queue_s=median_between(*p, QUEUE),
            p_prefill_step_s=median_between(*p, PREFILL),
            kv_copy_out_s=hook_median(hooks.get("p", []), "save"),
            load_s={r: hook_median(hooks.get(r, []), "load") for r in consumers},
            first_decode_s={r: median_between(*metrics[r], PREFILL) for r in consumers},
            consumer_queue_s={r: median_between(*metrics[r], QUEUE) for r in consumers},
        )


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One request's readings, seconds since the client sent it (the router's clock)."""

    ttft_s: float  # the client had its first token
    sent_s: float  # the router's calls went out (stamps_s.sent)
    first_token_s: float  # the first token came out of the router's run
    source: str  # who made the first token: "rld" or "md"
    ship_s: float | None  # P's sidecar: that source's leg, COMMIT -> acked
    p_round_trip_s: float | None = None  # the router's call to P until P answered (trace prefill_seconds)

    @property
    def router_s(self) -> float:
        """The router's own time: before its calls went out, and handing the token to the client."""
        return self.sent_s + (self.ttft_s - self.first_token_s)

    @classmethod
    def of(cls, trace: dict[str, Any], ttft_s: float, shipped: dict[str, Any]) -> RequestTimes | None:
        """From a request's trace, the client's TTFT and P's record of its transfer (``{}``: none)."""
        stamps = trace.get("stamps_s") or {}
        tokens = trace.get("tokens") or {}
        if "sent" not in stamps or "first_token" not in stamps or not tokens:
            return None
        source = next(iter(tokens))
        leg = (shipped.get("legs") or {}).get(source) or {}
        ship = leg.get("ship_seconds") if leg.get("ok") else None
        return cls(ttft_s, stamps["sent"], stamps["first_token"], source, ship, trace.get("prefill_seconds"))


TRANSFER = {"rld": "transfer_fast_path", "md": "transfer_wan"}
METHOD = {  # how each stage is measured: the JSON says it next to the table
    "router_admission_placement": "router stamps_s.sent: checks, admission, placement, set-up; per request",
    "p_queue": "P's vLLM histogram vllm:request_queue_time_seconds over the phase (1 ms buckets)",
    "prefill": "P's vLLM vllm:request_prefill_time_seconds median less kv_copy_out (inside that step)",
    "kv_copy_out": "P's connector hook timings: the saving steps' hook time (ALLOC answer, copy, COMMIT)",
    "transfer_fast_path": "P's sidecar /transfers, leg rld: ship_seconds (COMMIT -> RLD acked); per request",
    "transfer_wan": "P's sidecar /transfers, leg md: ship_seconds (COMMIT -> MD acked); per request",
    "consumer_load": "the consumer's connector hook timings: hook time of the steps that loaded",
    "first_decode": "the consumer's vLLM vllm:request_prefill_time_seconds (scheduled -> first token)",
    "first_byte": "router stamps_s.first_token -> the client had the token; per request",
}


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def stage_table(requests: Sequence[RequestTimes], engine: EngineSide) -> dict[str, Any]:
    """``ttft_stages`` (stage -> median seconds, in path order), ``router_ttft_share`` and
    ``ttft_stages_detail`` (scope, sum, residual, how each was measured) for the requests whose
    first token came from the consumer most of them had."""
    if not requests:
        return {"ttft_stages": {}, "router_ttft_share": None, "ttft_stages_detail": {}}
    sources = [r.source for r in requests]
    source = max(sorted(set(sources)), key=sources.count)  # a tie: the same one every time
    scoped = [r for r in requests if r.source == source]
    copy_out = engine.kv_copy_out_s
    prefill = engine.p_prefill_step_s
    if prefill is not None and copy_out is not None:
        prefill = max(prefill - copy_out, 0.0)
    raw: dict[str, float | None] = {
        "router_admission_placement": _median([r.sent_s for r in scoped]),
        "p_queue": engine.p_queue_s,
        "prefill": prefill,
        "kv_copy_out": copy_out,
        TRANSFER.get(source, f"transfer_{source}"): _median([r.ship_s for r in scoped]),
        "consumer_load": (engine.load_s or {}).get(source),
        "first_decode": (engine.first_decode_s or {}).get(source),
        "first_byte": _median([r.ttft_s - r.first_token_s for r in scoped]),
    }
    stages = {k: v for k, v in raw.items() if v is not None}
    ttft = statistics.median(r.ttft_s for r in scoped)
    ttft_all = statistics.median(r.ttft_s for r in requests)
    router = statistics.median(r.router_s for r in requests)
    return {
        "ttft_stages": stages,
        "router_ttft_share": router / ttft_all if ttft_all > 0 else None,
        "ttft_stages_detail": {
            "scope": f"the {len(scoped)} of {len(requests)} requests whose first token came from {source}",
            "first_token_from": {s: sources.count(s) for s in sorted(set(sources))},
            "ttft_median_s": ttft,
            "stages_sum_s": sum(stages.values()),
            "residual_s": ttft - sum(stages.values()),
            "missing": [k for k, v in raw.items() if v is None],
            "method": {k: METHOD.get(k, "") for k in stages},
            "router_median_s": router,
            "ttft_median_all_s": ttft_all,
            "cross_checks": _cross_checks(scoped, engine, source),
        },
    }


def _cross_checks(scoped: Sequence[RequestTimes], engine: EngineSide, source: str) -> dict[str, float | None]:
    """Readings that overlap the stages, for where the residual goes: P's round trip as the router
    saw it, the part of it outside P's engine (HTTP in, the answer out: only the part before P
    queues the request is on the consumer's path) and the consumer's own queue time (from its
    request's arrival, about when P's did, until its KV was loaded and a step took it)."""
    rt = _median([r.p_round_trip_s for r in scoped])
    inside = (
        None
        if engine.p_queue_s is None or engine.p_prefill_step_s is None
        else engine.p_queue_s + engine.p_prefill_step_s
    )
    return {
        "p_round_trip_s": rt,
        "p_outside_engine_s": None if rt is None or inside is None else rt - inside,
        "consumer_queue_s": (engine.consumer_queue_s or {}).get(source),
    }


def stage_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The stage table's lines for the demo's text report."""
    stages = report.get("ttft_stages") or {}
    detail = report.get("ttft_stages_detail") or {}
    if not stages:
        return []
    rows = [(f"TTFT stage: {k}", f"{v * 1000:.1f} ms") for k, v in stages.items()]
    rows += [
        (
            "TTFT stages sum / median TTFT",
            "{:.1f} / {:.1f} ms (residual {:.1f} ms: waits no clock splits)".format(
                detail["stages_sum_s"] * 1000, detail["ttft_median_s"] * 1000, detail["residual_s"] * 1000
            ),
        ),
        ("router's share of median TTFT", f"{report['router_ttft_share']:.1%} (target <= 10%)"),
    ]
    return rows
