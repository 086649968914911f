"""The workload file (``agentic-v1.json``): load, validate, and keep the figures typed.

``load_workload(path)`` parses the file and checks every field the generator and the simulator use;
a bad file raises ``TraceFormatError`` naming the field path and the line it sits on. The published
results are kept as given (a nested mapping) for side-by-side reports. Pure: reads one file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pddlink.sim.trace import TraceFormatError

# A verbatim copy of ../shared/workload/agentic-v1.json ships with the package, so the calibrated
# scenario runs from any install.
DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "data" / "agentic-v1.json"


@dataclass(frozen=True, slots=True)
class HitBin:
    lo: float
    hi: float
    share: float


@dataclass(frozen=True, slots=True)
class CdfPoint:
    tokens: int
    cdf: float


@dataclass(frozen=True, slots=True)
class Hardware:
    """Speeds relative to GPU A (prefill, decode) and prices relative to A."""

    e_prefill_rel: float
    e_decode_rel: float
    b_price_range: tuple[float, float]
    baseline_gpu_a: int
    pdd_gpu_a: int
    pdd_gpu_b: int
    pdd_rld_gpus: int


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    context_tokens: int
    hit_bins: tuple[HitBin, ...]
    hit_mean_target: float | None
    uniform_bins: tuple[HitBin, ...]
    output_cdf: tuple[CdfPoint, ...]
    singular_share: float
    rate_rps: float
    kv_bytes_per_token: int
    tpot_slo_s: tuple[float, float]
    ttft_quality_bound_s: float
    wan_gbps: float
    hardware: Hardware
    published: dict[str, Any]

    @property
    def mean_hit(self) -> float:
        return sum(b.share * (b.lo + b.hi) / 2 for b in self.hit_bins)


class _Locator:
    """Finds the line of a field path (``requests.prefix_hit_rate_bins[2].share``) in the raw text."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text = path, text

    def line(self, keys: list[str | int]) -> int:
        pos, repeat = 0, 0
        for key in keys:
            if isinstance(key, int):
                repeat = key  # the next key's (key+1)-th occurrence
                continue
            for _ in range(repeat + 1):
                m = re.compile(rf'"{re.escape(key)}"\s*:').search(self.text, pos)
                if m is None:
                    return self.text.count("\n", 0, pos) + 1
                pos = m.end()
            repeat = 0
        return self.text.count("\n", 0, pos) + 1

    def error(self, keys: list[str | int], message: str) -> TraceFormatError:
        name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".")
        return TraceFormatError(f"{self.path}:{self.line(keys)}: field '{name}': {message}")


class _Reader:
    def __init__(self, loc: _Locator, root: dict[str, Any]) -> None:
        self.loc, self.root = loc, root

    def get(self, keys: list[str | int], kind: type) -> Any:
        node: Any = self.root
        for i, key in enumerate(keys):
            container_ok = isinstance(node, list) if isinstance(key, int) else isinstance(node, dict)
            if (
                not container_ok
                or (isinstance(key, int) and key >= len(node))
                or (isinstance(key, str) and key not in node)
            ):
                raise self.loc.error(keys[: i + 1], "missing")
            node = node[key]
        if kind is float and isinstance(node, int | float) and not isinstance(node, bool):
            return float(node)
        if not isinstance(node, kind) or isinstance(node, bool):
            raise self.loc.error(keys, f"must be {kind.__name__}, got {node!r:.40}")
        return node

    def number(self, keys: list[str | int], lo: float, hi: float = float("inf")) -> float:
        value: float = self.get(keys, float)
        if not lo <= value <= hi:
            raise self.loc.error(keys, f"must be in [{lo}, {hi}], got {value}")
        return value

    def bins(self, keys: list[str | int]) -> tuple[HitBin, ...]:
        raw = self.get(keys, list)
        if not raw:
            raise self.loc.error(keys, "must not be empty")
        out = []
        for i in range(len(raw)):
            lo = self.number([*keys, i, "lo"], 0.0, 1.0)
            hi = self.number([*keys, i, "hi"], lo, 1.0)
            out.append(HitBin(lo, hi, self.number([*keys, i, "share"], 0.0, 1.0)))
        total = sum(b.share for b in out)
        if abs(total - 1.0) > 1e-6:
            raise self.loc.error(keys, f"shares must sum to 1, got {total:.4f}")
        return tuple(out)

    def cdf(self, keys: list[str | int]) -> tuple[CdfPoint, ...]:
        raw = self.get(keys, list)
        out: list[CdfPoint] = []
        for i in range(len(raw)):
            tokens = int(self.number([*keys, i, "tokens"], 1))
            cdf = self.number([*keys, i, "cdf"], 0.0, 1.0)
            if out and (tokens <= out[-1].tokens or cdf < out[-1].cdf):
                raise self.loc.error([*keys, i, "tokens"], "points must increase in tokens and cdf")
            out.append(CdfPoint(tokens, cdf))
        if not out or out[-1].cdf != 1.0:
            raise self.loc.error(keys, "the last point must have cdf 1.0")
        return tuple(out)


def _hardware(r: _Reader) -> Hardware:
    h = ["hardware"]
    b_range = r.get([*h, "gpu_b", "price_rel_range"], list)
    if len(b_range) != 2:
        raise r.loc.error([*h, "gpu_b", "price_rel_range"], "must be [lo, hi]")
    return Hardware(
        e_prefill_rel=r.number([*h, "chip_e_example", "prefill_rel"], 0.01),
        e_decode_rel=r.number([*h, "chip_e_example", "decode_rel"], 0.01),
        b_price_range=(
            r.number([*h, "gpu_b", "price_rel_range", 0], 0.01),
            r.number([*h, "gpu_b", "price_rel_range", 1], 0.01),
        ),
        baseline_gpu_a=int(r.number([*h, "baseline_intra_dc_pd", "gpu_a"], 1)),
        pdd_gpu_a=int(r.number([*h, "pdd", "gpu_a"], 1)),
        pdd_gpu_b=int(r.number([*h, "pdd", "gpu_b"], 1)),
        pdd_rld_gpus=int(r.number([*h, "pdd", "rld_gpus_in_experiments"], 1)),
    )


def load_workload(path: str | Path = DEFAULT_WORKLOAD) -> Workload:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        root = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}:{exc.lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(root, dict):
        raise TraceFormatError(f"{path}:1: expected a JSON object")
    r = _Reader(_Locator(path, text), root)
    req, model = ["requests"], ["model"]
    tpot = r.get([*model, "tpot_slo_ms"], list)
    if len(tpot) != 2:
        raise r.loc.error([*model, "tpot_slo_ms"], "must be [lo, hi]")
    return Workload(
        name=str(root.get("name", path.stem)),
        context_tokens=int(r.number([*req, "context_tokens", "typical"], 1)),
        hit_bins=r.bins([*req, "prefix_hit_rate_bins"]),
        hit_mean_target=(
            r.number([*req, "prefix_hit_rate_mean_target"], 0.0, 1.0)
            if "prefix_hit_rate_mean_target" in root.get("requests", {})
            else None
        ),
        uniform_bins=r.bins([*req, "uniform_contrast_bins"]),
        output_cdf=r.cdf([*req, "output_tokens_cdf"]),
        singular_share=r.number([*req, "singular_share"], 0.0, 1.0),
        rate_rps=r.number([*req, "arrival", "rate_rps"], 1e-9),
        kv_bytes_per_token=int(r.number([*model, "kv_bytes_per_token"], 1)),
        tpot_slo_s=(
            r.number([*model, "tpot_slo_ms", 0], 0.1) / 1e3,
            r.number([*model, "tpot_slo_ms", 1], 0.1) / 1e3,
        ),
        ttft_quality_bound_s=r.number([*model, "ttft_quality_bound_s"], 1e-3),
        wan_gbps=r.number(["network", "wan_gbps"], 1e-6),
        hardware=_hardware(r),
        published=dict(root.get("published_results", {})),
    )
