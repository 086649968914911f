"""The demo's figures: percentiles, token shares, handoffs, WAN bytes, DRC hit rate, mismatches;
the printed table, the JSON document (keys fixed by the acceptance check) and the TTFT plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from harness.demo_load import RequestResult


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    arr = np.asarray(values)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}


def summarize(
    results: list[RequestResult], reference: list[list[int]], counters: dict[str, float]
) -> dict[str, Any]:
    """One run's figures. Bytes and DRC hits come from the sidecars' own counters (``counters``:
    differences over the measured phase), so shipments that outlive their request count too."""
    ok = [r for r in results if r.outcome == "finished"]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = {"rld": 0, "md": 0}
    handoffs = {"one_shot": 0, "catch_up": 0}
    pipelines: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    prompt_tokens = cached = 0
    for r in results:
        for src, n in r.sources.items():
            tokens[src] = tokens.get(src, 0) + n
        t = r.trace
        pipelines[t.get("pipeline", "?")] = pipelines.get(t.get("pipeline", "?"), 0) + 1
        if t.get("handoff_outcome") == "handed_off" and t.get("handoff_mode") in handoffs:
            handoffs[t["handoff_mode"]] += 1
        for f in t.get("fallbacks", []):
            fallbacks[f] = fallbacks.get(f, 0) + 1
        if "md_cached_tokens" in t:
            prompt_tokens += t.get("prompt_tokens", 0)
            cached += t["md_cached_tokens"]
    mismatches = sum(1 for r in ok if r.tokens != reference[r.index])
    decode_s = sum(max(r.e2e_s - (r.ttft_s or 0.0), 1e-9) for r in ok)
    out_tokens = sum(len(r.tokens) for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "failures": sorted({r.reason for r in results if r.outcome != "finished"})[:5],
        "token_mismatches": mismatches,
        "ttft_s": percentiles(ttft),
        "ttft_values": ttft,
        "tokens": tokens,
        "tokens_per_s_per_request": (out_tokens - len(ok)) / decode_s if decode_s else 0.0,
        "handoffs": handoffs,
        "singular": pipelines.get("singular", 0),
        "pipelines": pipelines,
        "fallbacks": fallbacks,
        "wan_bytes": int(counters.get("kv_bytes_wan", 0)),
        "fast_bytes": int(counters.get("kv_bytes_fast", 0)),
        "drc_hit_rate": counters.get("drc_hit_blocks", 0.0)
        / max(counters.get("drc_lookup_blocks", 0.0), 1.0),
        "reservation_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
    }


def document(base: dict[str, Any], pdd: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document: the acceptance keys first, then detail per run."""
    strip = {k: v for k, v in pdd.items() if k != "ttft_values"}
    return {
        "requests": pdd["requests"],
        "failed": base["failed"] + pdd["failed"],
        "token_mismatches": base["token_mismatches"] + pdd["token_mismatches"],
        "ttft_s": {"baseline": base["ttft_s"], "pdd": pdd["ttft_s"]},
        "tokens": {"rld": pdd["tokens"].get("rld", 0), "md": pdd["tokens"].get("md", 0)},
        "handoffs": pdd["handoffs"],
        "singular": pdd["singular"],
        "wan_bytes": {"baseline": base["wan_bytes"], "pdd": pdd["wan_bytes"]},
        "drc_hit_rate": pdd["drc_hit_rate"],
        "p90_ratio": pdd["ttft_s"]["p90"] / base["ttft_s"]["p90"] if base["ttft_s"]["p90"] else None,
        "output_tokens_per_s": {
            "baseline": base["tokens_per_s_per_request"],
            "pdd": pdd["tokens_per_s_per_request"],
        },
        "setting": setting,
        "baseline": {k: v for k, v in base.items() if k != "ttft_values"},
        "pdd": strip,
    }


def table(doc: dict[str, Any]) -> str:
    b, p = doc["baseline"], doc["pdd"]
    rows = [
        ("requests", b["requests"], p["requests"]),
        ("TTFT P50 (s)", f"{b['ttft_s']['p50']:.3f}", f"{p['ttft_s']['p50']:.3f}"),
        ("TTFT P90 (s)", f"{b['ttft_s']['p90']:.3f}", f"{p['ttft_s']['p90']:.3f}"),
        ("TTFT P99 (s)", f"{b['ttft_s']['p99']:.3f}", f"{p['ttft_s']['p99']:.3f}"),
        (
            "output speed (tok/s per request)",
            f"{b['tokens_per_s_per_request']:.1f}",
            f"{p['tokens_per_s_per_request']:.1f}",
        ),
        (
            "tokens from RLD / MD",
            f"{b['tokens'].get('rld', 0)} / {b['tokens'].get('md', 0)}",
            f"{p['tokens'].get('rld', 0)} / {p['tokens'].get('md', 0)}",
        ),
        ("handoffs one-shot / catch-up", "-", f"{p['handoffs']['one_shot']} / {p['handoffs']['catch_up']}"),
        ("singular requests", b["singular"], p["singular"]),
        ("pipelines", _kv(b["pipelines"]), _kv(p["pipelines"])),
        ("fallbacks", _kv(b["fallbacks"]) or "-", _kv(p["fallbacks"]) or "-"),
        ("WAN bytes (MB)", f"{b['wan_bytes'] / 1e6:.1f}", f"{p['wan_bytes'] / 1e6:.1f}"),
        ("fast-path bytes (MB)", f"{b['fast_bytes'] / 1e6:.1f}", f"{p['fast_bytes'] / 1e6:.1f}"),
        ("DRC hit rate (MD's blocks)", f"{b['drc_hit_rate']:.3f}", f"{p['drc_hit_rate']:.3f}"),
        ("failed", b["failed"], p["failed"]),
        ("token mismatches vs one engine alone", b["token_mismatches"], p["token_mismatches"]),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':{w}}  {'P->MD baseline':>22}  {'PDD':>22}"]
    lines += [f"{name:{w}}  {bv!s:>22}  {pv!s:>22}" for name, bv, pv in rows]
    ratio = doc.get("p90_ratio")
    if ratio is not None:
        lines.append(f"PDD TTFT P90 = {ratio:.2f}x baseline (published: 0.54x)")
    return "\n".join(lines)


def _kv(d: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items()))


def plot(base: dict[str, Any], pdd: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, run in (("P->MD baseline", base), ("PDD", pdd)):
        vals = np.sort(np.asarray(run["ttft_values"]))
        if len(vals):
            ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.9, color="grey", lw=0.5, ls="--")
    ax.set_title("pddlink demo: TTFT distribution")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
