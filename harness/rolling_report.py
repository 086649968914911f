"""The rolling-restart and etcd-outage demo's figures, tables and timelines
(``harness.demo_rolling``): the JSON documents, the text tables, and one PNG per scenario with
every request as a line from sent to ended (green finished, red failed, black hung) over the spans
where a process was away (SIGTERM until serving again) or etcd was down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.rolling import RestartStep, Timed, load_figures, step_figures


def mismatches(load: Sequence[Timed], reference: Mapping[int, list[int]]) -> int:
    return sum(1 for t in load if t.outcome == "finished" and list(t.tokens) != reference[t.index])


def rolling_doc(
    load: list[Timed], steps: list[RestartStep], reference: Mapping[int, list[int]], png: Path
) -> dict[str, Any]:
    spans = [(s.process, s.term_s, s.serving_s) for s in steps]
    plot_timeline(load, spans, png, "rolling restart of every process under load")
    return {
        "load": load_figures(load, mismatches(load, reference)),
        "restarts": [step_figures(s, load) for s in steps],
        "span_s": round(max((t.ended_s for t in load), default=0.0), 2),
        "plot": str(png),
    }


def outage_doc(
    baseline: list[Timed],
    outage: list[Timed],
    facts: dict[str, Any],
    outage_s: float,
    reference: Mapping[int, list[int]],
    png: Path,
    joined_md: str,
) -> dict[str, Any]:
    down, up = facts.get("down_s", 0.0), facts.get("up_s", 0.0)
    plot_timeline(outage, [("etcd down", down, up)], png, f"etcd stopped for {outage_s:.0f} s under load")
    base = load_figures(baseline, mismatches(baseline, reference))
    out = load_figures(outage, mismatches(outage, reference))
    during = [t for t in outage if t.overlaps(down, up)]
    return {
        "outage_s": outage_s,
        "baseline": base,
        "outage": out,
        "extra_failed": max(0, out["failed"] - base["failed"]),
        "during_outage": {
            "requests": len(during),
            "failed": sum(t.outcome != "finished" for t in during),
            "on_joined_md": sum(t.where.get("md") == joined_md for t in during),
            "by_md": dict(sorted(Counter(t.where.get("md", "?") for t in during).items())),
        },
        "joined_md": joined_md,
        **facts,
        "plot": str(png),
    }


def table_rolling(doc: dict[str, Any]) -> str:
    lines = [
        f"{'restart':>10} {'role':>6} {'SIGTERM':>8} {'exit':>6} {'code':>4} {'serving':>8}  "
        f"{'in flight':>9} {'on it':>5} {'(ok)':>4}  {'during':>6} {'ok':>4} {'failed':>6}  reasons",
        f"{'':>10} {'':>6} {'at s':>8} {'+s':>6} {'':>4} {'+s':>8}",
    ]
    for r in doc["restarts"]:
        code = "kill" if r["exit_code"] is None else str(r["exit_code"])
        reasons = "; ".join(f"{n}x {why}" for why, n in r["failure_reasons"].items())
        lines.append(
            f"{r['process']:>10} {r['role']:>6} {r['term_s']:>8.1f} {r['exit_s'] - r['term_s']:>6.1f} "
            f"{code:>4} {r['down_s']:>8.1f}  {r['in_flight_at_term']:>9} {r['in_flight_on_it']:>5} "
            f"{r['in_flight_on_it_finished']:>4}  {r['during']:>6} {r['finished']:>4} {r['failed']:>6}  "
            f"{reasons}"
        )
    f = doc["load"]
    lines.append(
        f"load: {f['requests']} requests over {doc['span_s']:.0f} s: {f['finished']} finished, "
        f"{f['failed']} failed ({f['failed_share']:.2%}), {f['hung']} hung, "
        f"{f['token_mismatches']} token mismatches; timeline {doc['plot']}"
    )
    lines += [f"  failed: {n}x {why}" for why, n in f["failure_reasons"].items()]
    return "\n".join(lines)


def table_outage(doc: dict[str, Any]) -> str:
    lines = [f"{'run':>9}  {'requests':>8} {'finished':>8} {'failed':>6} {'hung':>4} {'mism.':>5}  reasons"]
    for name in ("baseline", "outage"):
        f = doc[name]
        reasons = "; ".join(f"{n}x {why}" for why, n in f["failure_reasons"].items())
        lines.append(
            f"{name:>9}  {f['requests']:>8} {f['finished']:>8} {f['failed']:>6} {f['hung']:>4} "
            f"{f['token_mismatches']:>5}  {reasons}"
        )
    d, joined = doc["during_outage"], doc["joined_md"]
    stale = ", ".join(f"{k} {v:.0%}" for k, v in doc.get("stale_seen", {}).items())
    kept = [r for r, view in doc.get("in_placement_during", {}).items() if view.get(joined)]
    by_md = ", ".join(f"{md} {n}" for md, n in d.get("by_md", {}).items())
    lines += [
        f"etcd down {doc.get('down_s', 0):.1f}-{doc.get('up_s', 0):.1f} s: {d['requests']} requests ran, "
        f"{d['failed']} failed; placed on {by_md}",
        f"  routers said stale: {stale}; {joined} (known from etcd only) still in placement at "
        f"{len(kept)}/{len(doc.get('in_placement_during', {}))} routers, {d['on_joined_md']} requests on it; "
        f"fresh again {doc.get('fresh_after_s')} s after etcd was back",
        f"  failed beyond the baseline: {doc['extra_failed']}; timeline {doc['plot']}",
    ]
    return "\n".join(lines)


def plot_timeline(
    load: Sequence[Timed], spans: Sequence[tuple[str, float, float]], path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 7.5), sharex=True, height_ratios=(3, 1))
    colors = {"finished": "tab:green", "failed": "tab:red", "rejected": "tab:orange"}
    for y, t in enumerate(sorted(load, key=lambda t: t.sent_s)):
        color = "black" if t.hung else colors.get(t.outcome, "tab:red")
        top.plot([t.sent_s, t.ended_s], [y, y], color=color, lw=0.8 if t.outcome == "finished" else 1.6)
        if t.outcome != "finished":
            top.scatter([t.ended_s], [y], color=color, marker="x", zorder=3)
    end = max((t.ended_s for t in load), default=1.0)
    for k, (name, a, b) in enumerate(spans):
        for ax in (top, bottom):
            ax.axvspan(a, b, color="tab:blue" if k % 2 else "tab:purple", alpha=0.12)
        top.text(a, len(load) * 1.01, name, rotation=60, fontsize=7, va="bottom")
    step = 0.5
    grid = [i * step for i in range(int(end / step) + 2)]
    bottom.plot(grid, [sum(t.sent_s <= x < t.ended_s for t in load) for x in grid], color="tab:gray")
    failed = sorted(t.ended_s for t in load if t.outcome != "finished")
    if failed:
        bottom.scatter(failed, [0] * len(failed), color="tab:red", marker="x", zorder=3, label="failed")
        bottom.legend(loc="upper right", fontsize=8)
    top.set_ylabel("request (by send time)")
    bottom.set_ylabel("in flight")
    bottom.set_xlabel("seconds since the load started")
    n_failed = sum(t.outcome != "finished" for t in load)
    top.set_title(f"{title}: {len(load)} requests, {n_failed} failed", pad=40)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
