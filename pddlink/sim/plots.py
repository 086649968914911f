"""PNG plots of simulated runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from pddlink.sim.records import RunRecords


def _cdf(ax: matplotlib.axes.Axes, values: np.ndarray, label: str) -> None:
    if values.size:
        xs = np.sort(values)
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)


def _plot_cdfs(series: Mapping[str, np.ndarray], xlabel: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        _cdf(ax, values, name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdfs(runs: Mapping[str, RunRecords], path: Path) -> Path:
    """TTFT CDF per deployment."""
    return _plot_cdfs({name: rec.ttft() for name, rec in runs.items()}, "TTFT (s)", path)


def plot_kv_transfer(samples: Mapping[str, np.ndarray], path: Path) -> Path:
    """KV transfer latency CDFs (skewed vs uniform hits on the same line)."""
    return _plot_cdfs(samples, "KV transfer latency (s)", path)


def plot_wan_load(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """The WAN-load sweep: goodput, TTFT P90, RelayDecode's token share and the rejected share
    against the offered suffix load (x the line), one line per deployment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels: tuple[tuple[str, Callable[[Mapping[str, Any]], Any]], ...] = (
        ("SLA goodput (req/s)", lambda r: r["goodput_rps"]),
        ("TTFT P90 (s)", lambda r: r["ttft_s"]["p90"]),
        ("RelayDecode token share", lambda r: r["rld_token_share"]),
        ("rejected share", lambda r: r["rejected_share"]),
    )
    names = sorted({str(r["deployment"]) for r in rows})
    for ax, (label, value) in zip(axes.flat, panels, strict=True):
        for name in names:
            mine = sorted((r for r in rows if r["deployment"] == name), key=lambda r: float(r["wan_load"]))
            ax.plot([r["wan_load"] for r in mine], [value(r) for r in mine], marker="o", label=name)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("offered WAN load of the missing suffixes (x line rate)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
