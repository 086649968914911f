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
    rejected = sum(r.outcome == "rejected" for r in results)
    ttft_ok = [r.ttft_s for r in ok if r.ttft_s is not None]
    # a request that failed before its first token counts at the time it failed: a lower bound on
    # what the client waited (so a baseline that fails most requests is not judged by the few it
    # finished); rejected ones are counted apart, not here
    ttft = ttft_ok + [r.ttft_s if r.ttft_s is not None else r.e2e_s for r in results if r.outcome == "failed"]
    tokens = {"rld": 0, "md": 0}
    handoffs = {"one_shot": 0, "catch_up": 0}
    pipelines: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    prompt_tokens = cached = 0
    p_blocks_tokens = p_cached = 0
    decisions = {o: 0 for o in ("ship", "relay", "recompute", "relay_recompute", "singular", "rejected")}
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
        option = t.get("option", "ship" if t.get("pipeline") == "p_md" else t.get("pipeline", "?"))
        option = {"p_rld_md": "relay"}.get(option, option)
        decisions[option] = decisions.get(option, 0) + 1
        if "p_cached_tokens" in t:  # P prefilled it: its own prefix cache's hit, in full blocks
            p_blocks_tokens += t.get("prompt_tokens", 0) // 16 * 16
            p_cached += t["p_cached_tokens"]
    mismatches = sum(1 for r in ok if r.tokens != reference[r.index])
    decode_s = sum(max(r.e2e_s - (r.ttft_s or 0.0), 1e-9) for r in ok)
    out_tokens = sum(len(r.tokens) for r in ok)
    produced = tokens.get("rld", 0) + tokens.get("md", 0)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok) - rejected,
        "rejected": rejected,
        "decisions": decisions,
        "failures": sorted({r.reason for r in results if r.outcome == "failed"})[:5],
        "token_mismatches": mismatches,
        "ttft_s": percentiles(ttft),
        "ttft_finished_s": percentiles(ttft_ok),
        "ttft_values": ttft,
        "tokens": tokens,
        "tokens_per_s_per_request": (out_tokens - len(ok)) / decode_s if decode_s else 0.0,
        "handoffs": handoffs,
        "singular": pipelines.get("singular", 0),
        "pipelines": pipelines,
        "fallbacks": fallbacks,
        "wan_bytes": int(counters.get("kv_bytes_wan", 0)),
        "codec": codec_summary(counters),
        "fast_bytes": int(counters.get("kv_bytes_fast", 0)),
        "drc_hit_rate": counters.get("drc_hit_blocks", 0.0)
        / max(counters.get("drc_lookup_blocks", 0.0), 1.0),
        "reservation_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "p_prefix_hit_rate": p_cached / p_blocks_tokens if p_blocks_tokens else 0.0,
        "rld_token_share": tokens.get("rld", 0) / produced if produced else 0.0,
    }


def codec_summary(counters: dict[str, float], path: str = "wan") -> dict[str, Any]:
    """The codec on one path from P's counters: the codec that carried most KV, the ratio over all
    of it (KV bytes before the codec / bytes on the wire), bytes saved, and the split by codec."""
    by: dict[str, dict[str, float]] = {}
    for key, value in counters.items():
        for kind in ("raw", "wire"):
            prefix = f"codec_{kind}_{path}_"
            if key.startswith(prefix):
                by.setdefault(key[len(prefix) :], {"raw": 0.0, "wire": 0.0})[kind] += value
    raw = sum(v["raw"] for v in by.values())
    wire = sum(v["wire"] for v in by.values())
    carried = {name: v for name, v in by.items() if v["raw"] > 0}
    name = max(carried, key=lambda n: carried[n]["raw"]) if carried else "raw"
    return {
        "name": name,
        "ratio": raw / wire if wire else 1.0,
        "bytes_saved": int(raw - wire),
        "kv_bytes": int(raw),
        "wire_bytes": int(wire),
        "by_codec": {
            n: {"kv_bytes": int(v["raw"]), "wire_bytes": int(v["wire"])} for n, v in carried.items()
        },
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
        "codec": pdd["codec"],
        "p90_ratio": pdd["ttft_s"]["p90"] / base["ttft_s"]["p90"] if base["ttft_s"]["p90"] else None,
        "output_tokens_per_s": {
            "baseline": base["tokens_per_s_per_request"],
            "pdd": pdd["tokens_per_s_per_request"],
        },
        "setting": setting,
        "baseline": {k: v for k, v in base.items() if k != "ttft_values"},
        "pdd": strip,
    }


def _codec(c: dict[str, Any]) -> str:
    return f"{c['name']}, {c['ratio']:.2f}x, {c['bytes_saved'] / 1e6:.1f}"


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
        ("WAN codec, ratio, MB saved", _codec(b["codec"]), _codec(p["codec"])),
        ("fast-path bytes (MB)", f"{b['fast_bytes'] / 1e6:.1f}", f"{p['fast_bytes'] / 1e6:.1f}"),
        ("DRC hit rate (MD's blocks)", f"{b['drc_hit_rate']:.3f}", f"{p['drc_hit_rate']:.3f}"),
        ("P's prefix hit rate", f"{b['p_prefix_hit_rate']:.3f}", f"{p['p_prefix_hit_rate']:.3f}"),
        ("RLD token share", f"{b['rld_token_share']:.1%}", f"{p['rld_token_share']:.1%}"),
        ("decisions", _kv(b["decisions"]), _kv(p["decisions"])),
        ("rejected (at once, by admission)", b["rejected"], p["rejected"]),
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
