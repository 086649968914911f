"""PNG plots of simulated runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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
