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


Panel = tuple[str, Callable[[Mapping[str, Any]], Any]]


def _plot_panels(
    rows: Sequence[Mapping[str, Any]], over: str, xlabel: str, panels: Sequence[Panel], path: Path
) -> Path:
    """One panel per figure, one line per deployment, ``over`` on the x axis."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ncols = 2
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(10, 3.4 * nrows), sharex=True, squeeze=False)
    names = sorted({str(r["deployment"]) for r in rows})
    for ax, (label, value) in zip(axes.flat, panels, strict=False):
        for name in names:
            mine = sorted((r for r in rows if r["deployment"] == name), key=lambda r: float(r[over]))
            style = {"linewidth": 2.5} if name == "pdd_bounded" else {}
            ax.plot([r[over] for r in mine], [value(r) for r in mine], marker="o", label=name, **style)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_wan_load(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """The WAN-load sweep: goodput (both SLOs), TTFT P90, TPOT P90, output speed per request,
    RelayDecode's token share and the rejected share against the offered suffix load (x the line)."""
    panels: tuple[Panel, ...] = (
        ("goodput, TTFT and TPOT SLO (req/s)", lambda r: r["goodput_rps"]),
        ("TTFT P90 (s)", lambda r: r["ttft_s"]["p90"]),
        ("TPOT P90 (s)", lambda r: r["tpot_s"]["p90"]),
        ("output tokens/s per request (median)", lambda r: r["tokens_per_s_per_request"]),
        ("RelayDecode token share", lambda r: r["rld_token_share"]),
        ("rejected share", lambda r: r["rejected_share"]),
    )
    return _plot_panels(
        rows, "wan_load", "offered WAN load of the missing suffixes (x line rate)", panels, path
    )


def plot_bathtub(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Benefit per cost (BCR) and sustained goodput against the mean prefix hit rate, and TPOT P90
    and the rejected share at the offered rate, one line per deployment."""
    panels: tuple[Panel, ...] = (
        ("BCR (goodput per cost / intra-DC PD's)", lambda r: r["bcr"]),
        ("sustained goodput, both SLOs (req/s)", lambda r: r["goodput_rps"]),
        ("TPOT P90 at the offered rate (s)", lambda r: r["tpot_s"]["p90"]),
        ("rejected share at the offered rate", lambda r: r["rejected_share"]),
    )
    return _plot_panels(rows, "hit", "mean prefix hit rate on the decode side", panels, path)
