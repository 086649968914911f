"""The chaos run's table (stdout) and its PNG timeline: one line per request from start to end,
coloured by how it ended, over the fault windows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.chaos.invariants import FaultRecord
from harness.chaos.load import StreamResult

COLOURS = {"finished": "tab:green", "failed": "tab:red", "refused": "tab:orange", "hung": "black"}


def table(doc: dict[str, Any]) -> str:
    held = doc["held_after_s10"]
    rows = [
        ("requests", doc["requests"]),
        ("finished", doc["finished"]),
        ("failed", doc["failed"]),
        ("refused", doc["refused"]),
        ("hung (> deadline + 1 s)", doc["hung"]),
        ("failures without a reason", doc["untyped_failures"]),
        ("token mismatches", doc["token_mismatches"]),
        ("gaps / duplicates", f"{doc['gaps']} / {doc['duplicates']}"),
        (
            "held 10 s after (kv_blocks, leases, waiting)",
            f"{held['kv_blocks']}, {held['leases']}, {held['waiting']}",
        ),
        ("RSS growth, max (end / after warm-up)", f"x{doc['rss_growth_max']:.3f}"),
        (
            "long outage: RLD-backed in flight that finished",
            f"{doc['outage_rld_finish_share']:.0%} of {doc['outage_rld_in_flight']}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append(f"{'fault':<22}{'start s':>9}{'end s':>9}{'in flight':>11}{'finished':>10}  failures")
    for f in doc["faults"]:
        reasons = ", ".join(f"{k} x{n}" for k, n in f["failed_reasons"].items()) or "-"
        lines.append(
            f"{f['name']:<22}{f['start_s']:>9.1f}{f['end_s']:>9.1f}{f['in_flight']:>11}"
            f"{f['finished']:>10}  {reasons}"
        )
    if doc["failure_reasons"]:
        lines.append("")
        lines.append(
            "why requests did not finish: "
            + ", ".join(f"{k} x{n}" for k, n in doc["failure_reasons"].items())
        )
    return "\n".join(lines)


def timeline(results: Sequence[StreamResult], faults: Sequence[FaultRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(results, key=lambda r: r.started_s)
    fig, ax = plt.subplots(figsize=(10, 5))
    for f in faults:
        ax.axvspan(f.start_s, max(f.end_s, f.start_s + 0.2), color="tab:blue", alpha=0.15)
        ax.text(f.start_s, len(ordered) * 1.01, f.name, rotation=30, fontsize=7, va="bottom")
    for outcome, colour in COLOURS.items():
        rows = [(i, r) for i, r in enumerate(ordered) if r.outcome == outcome]
        if rows:
            ax.hlines(
                [i for i, _ in rows],
                [r.started_s for _, r in rows],
                [r.ended_s for _, r in rows],
                colors=colour,
                linewidth=0.8,
                label=f"{outcome} ({len(rows)})",
            )
    ax.set_xlabel("seconds since the load began")
    ax.set_ylabel("request (by start)")
    ax.set_title("pddlink chaos: requests over the fault windows (shaded)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
