"""The workload file: typed figures, and errors that name the field and its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pddlink.sim.generate import GeneratorConfig, generate, within_bin_exponent
from pddlink.sim.trace import TraceFormatError
from pddlink.sim.workload import DEFAULT_WORKLOAD, load_workload


def test_published_figures_load() -> None:
    w = load_workload()
    assert w.context_tokens == 65536 and w.kv_bytes_per_token == 4400 and w.rate_rps == 80
    assert len(w.hit_bins) == 7 and abs(sum(b.share for b in w.hit_bins) - 1) < 1e-9
    assert w.hardware.baseline_gpu_a == 88 and w.hardware.pdd_gpu_b == 32
    assert w.tpot_slo_s == (0.01, 0.03)


def _broken(tmp_path: Path, edit: str) -> Path:
    text = DEFAULT_WORKLOAD.read_text()
    path = tmp_path / "w.json"
    if edit == "share":
        text = text.replace(
            '{"lo": 0.90, "hi": 0.95, "share": 0.07}', '{"lo": 0.90, "hi": 0.95, "share": "x"}'
        )
    elif edit == "missing":
        text = text.replace('"kv_bytes_per_token": 4400,', "")
    elif edit == "sum":
        text = text.replace('"share": 0.45', '"share": 0.55')
    elif edit == "syntax":
        text = text.replace('"singular_share": 0.035,', '"singular_share": 0.035,,')
    path.write_text(text)
    return path


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_bad_field_names_path_and_line(tmp_path: Path) -> None:
    path = _broken(tmp_path, "share")
    with pytest.raises(TraceFormatError) as err:
        load_workload(path)
    msg = err.value.message
    assert "requests.prefix_hit_rate_bins[3].share" in msg and "must be float" in msg
    line = _line_of(path, '"share": "x"')
    assert f"{path}:{line}:" in msg


def test_missing_field_and_bad_sum_and_syntax(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"model\.kv_bytes_per_token': missing"):
        load_workload(_broken(tmp_path, "missing"))
    with pytest.raises(TraceFormatError, match="shares must sum to 1"):
        load_workload(_broken(tmp_path, "sum"))
    path = _broken(tmp_path, "syntax")
    with pytest.raises(TraceFormatError, match=rf"w.json:{_line_of(path, ',,')}: not JSON"):
        load_workload(path)


def test_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(TraceFormatError, match="expected a JSON object"):
        load_workload(path)


def test_within_bin_exponent_hits_the_mean_target() -> None:
    w = load_workload()
    a = within_bin_exponent(w.hit_bins, 0.90)
    mean = sum(b.share * (b.lo + (b.hi - b.lo) * a / (a + 1)) for b in w.hit_bins)
    assert abs(mean - 0.90) < 1e-6 and a > 1
    assert within_bin_exponent(w.uniform_bins, 0.90) == pytest.approx(1.0)


def test_generated_hits_come_from_prefix_structure() -> None:
    """Replay through an unlimited prefix set: the realised hits follow the bins (skewed, mean ~0.9)."""
    w = load_workload()
    b = 512
    seen: set[int] = set()
    hits, singular, total = [], 0, 0
    for r in generate(w, GeneratorConfig(rate_rps=40, duration_s=150, seed=3, block_tokens=b)):
        full = r.block_ids[: r.prompt_tokens // b]
        k = 0
        while k < len(full) and full[k] in seen:
            k += 1
        if r.arrival_s > 70:
            hits.append(k * b / r.prompt_tokens)
            singular += r.max_tokens <= 16
            total += 1
        seen.update(full)
    mean = sum(hits) / len(hits)
    above_95 = sum(h > 0.95 for h in hits) / len(hits)
    assert 0.86 < mean < 0.92, mean
    assert 0.65 < above_95 < 0.85, above_95
    assert 0.02 < singular / total < 0.05
