"""Per-request records of one simulated run, and the figures computed from them.

A ``Record`` is filled in as its request moves through the simulation (times in simulated seconds,
-1 until known). ``RunRecords.summary`` turns the measured ones (arrived after the warm-up) into
TTFT / TPOT / end-to-end percentiles, SLA attainment and goodput (requests per second of the
measured window meeting both the TTFT and the TPOT bound of the ``Sla``), output speed per request
(the median of each request's output tokens per second after its first), token shares by tier, KV transfer
latencies and line figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pddlink.routing import HandoffMode, Option, Pipeline
from pddlink.sim.wan import LineStats


class Record:
    __slots__ = (
        "arrival_s", "decode", "finish_s", "first_token_s", "handoff", "hit", "kv_transfer_s", "md_start_s",
        "md_tokens", "measured", "missing_tokens", "option", "output_tokens", "pipeline",
        "prefill_done_s", "rejected", "rld_tokens",
    )  # fmt: skip

    def __init__(self, arrival_s: float, output_tokens: int, pipeline: Pipeline, measured: bool) -> None:
        self.arrival_s, self.output_tokens, self.pipeline, self.measured = (
            arrival_s, output_tokens, pipeline, measured,
        )  # fmt: skip
        self.first_token_s = self.finish_s = self.prefill_done_s = self.md_start_s = -1.0
        self.kv_transfer_s = -1.0
        self.rld_tokens = self.md_tokens = self.missing_tokens = 0
        self.hit = 0.0
        self.handoff: HandoffMode | None = None
        self.option: Option | None = None  # None: rejected at arrival (``rejected``)
        self.rejected = False
        self.decode = ""  # the decode instance placement chose


@dataclass(frozen=True, slots=True)
class Sla:
    ttft_s: float
    tpot_s: float


def percentiles(values: np.ndarray) -> dict[str, float | None]:
    """p50/p90/p99, rounded; None (JSON null) when there are no samples."""
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p50), 4), "p90": round(float(p90), 4), "p99": round(float(p99), 4)}


@dataclass(slots=True)
class RunRecords:
    records: list[Record] = field(default_factory=list)
    simulated_s: float = 0.0
    measured_s: float = 0.0
    line: LineStats = field(default_factory=LineStats)  # over the measured window
    pool_size: int = 1
    events: int = 0
    sites: dict[str, LineStats] = field(default_factory=dict)  # each decode site's line, measured window
    wan_bytes: dict[str, int] = field(default_factory=dict)  # KV bytes measured requests put on each line

    def add(self, record: Record) -> None:
        self.records.append(record)

    def measured(self) -> list[Record]:
        return [r for r in self.records if r.measured and r.finish_s >= 0]

    def ttft(self) -> np.ndarray:
        return np.array([r.first_token_s - r.arrival_s for r in self.measured()])

    def kv_transfer(self) -> np.ndarray:
        return np.array([r.kv_transfer_s for r in self.measured() if r.kv_transfer_s >= 0])

    def line_figures(self, line_bytes_s: float) -> dict[str, float]:
        """The line over the measured window (``measured_s``, from the warm-up to the last arrival):
        ``wan_utilisation`` (bytes delivered / what the line can carry), ``pool_full_share`` (share of
        the time every pooled connection carried a transfer), ``pool_utilisation`` (mean share of the
        connections carrying one), ``transfers_in_flight`` (mean, waiting ones included) and
        ``pool_wait_s`` (mean wait for a connection per transfer; FIFO pools only)."""
        line, window = self.line, max(1e-9, self.measured_s)
        return {
            "wan_utilisation": round(line.delivered_bytes / (line_bytes_s * window), 4),
            "pool_full_share": round(line.pool_full_s / window, 4),
            "pool_utilisation": round(line.held_s / (self.pool_size * window), 4),
            "transfers_in_flight": round(line.flows_s / window, 2),
            "pool_wait_s": round(line.wait_s / line.transfers, 4) if line.transfers else 0.0,
        }

    def summary(self, sla: Sla, line_bytes_s: float) -> dict[str, Any]:
        recs = self.measured()
        ttft = np.array([r.first_token_s - r.arrival_s for r in recs])
        e2e = np.array([r.finish_s - r.arrival_s for r in recs])
        out = np.array([r.output_tokens for r in recs])
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(1, out - 1), 0.0)
        ok = (ttft <= sla.ttft_s) & (tpot <= sla.tpot_s)
        many = out > 1
        speed = (out[many] - 1) / np.maximum(1e-9, (e2e - ttft)[many])  # output tokens/s per request
        rld = sum(r.rld_tokens for r in recs)
        total = int(out.sum()) if recs else 0
        pipes = {p.value: sum(1 for r in recs if r.pipeline is p) for p in Pipeline}
        arrived = [r for r in self.records if r.measured]
        rejected = sum(1 for r in arrived if r.rejected)
        decisions = {o.value: sum(1 for r in arrived if r.option is o) for o in Option}
        decisions["rejected"] = rejected
        modes = {m.value: sum(1 for r in recs if r.handoff is m) for m in HandoffMode}
        return {
            "requests": len(recs),
            "unfinished": sum(1 for r in arrived if r.finish_s < 0 and not r.rejected),
            "rejected": rejected,
            "rejected_share": round(rejected / len(arrived), 4) if arrived else 0.0,
            "decisions": decisions,
            "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot[out > 1]),
            "e2e_s": percentiles(e2e),
            "sla_attainment": round(float(ok.mean()), 4) if recs else 0.0,
            "sla_goodput_rps": round(float(ok.sum()) / self.measured_s, 4),
            "tokens_per_s_per_request": round(float(np.median(speed)), 2) if speed.size else 0.0,
            "slo": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s},
            "rld_token_share": round(rld / total, 4) if total else 0.0,
            "pipelines": pipes,
            "handoffs": modes,
            "mean_hit": round(float(np.mean([r.hit for r in recs])), 4) if recs else 0.0,
            "kv_transfer_s": percentiles(self.kv_transfer()),
            **self.line_figures(line_bytes_s),
        }
