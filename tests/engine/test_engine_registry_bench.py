"""The engine registry and ``pddlink bench engine --json`` (a quick run on the tiny preset)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from engines_adapter import ENGINES, EngineAdapter, load_engine
from pddlink.cli.bench_engine import command
from pddlink.errors import ConfigError


def test_load_engine_by_name() -> None:
    eng = load_engine("torch_ref", preset="tiny", dtype="float64", num_blocks=32)
    assert isinstance(eng, EngineAdapter)
    assert eng.layout.dtype == "float64" and eng.vocab_size == 2048
    assert set(ENGINES) >= {"torch_ref", "hf"}


def test_unknown_engine_and_preset_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown engine"):
        load_engine("vllm-nope")
    with pytest.raises(ConfigError, match="unknown preset"):
        load_engine("torch_ref", preset="huge")
    with pytest.raises(ConfigError, match="dtype"):
        load_engine("torch_ref", dtype="int4")


def test_bench_engine_json_has_the_issue_keys() -> None:
    res = CliRunner().invoke(
        command,
        ["--json", "--preset", "tiny", "--prompt-tokens", "64", "--repeats", "1", "--decode-steps", "2"],
    )
    assert res.exit_code == 0, res.output
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(figures) >= {"prefill_tokens_per_s", "decode_step_ms", "extend_100_ms", "decode_100_ms"}
    assert set(figures["decode_step_ms"]) == {"1", "8"}
    assert all(
        v > 0 for v in (figures["prefill_tokens_per_s"], figures["extend_100_ms"], figures["decode_100_ms"])
    )
    assert figures["extend_100_ms"] < figures["decode_100_ms"]


def test_presets_are_valid_and_llama_1b_has_llama_3_2_1b_shapes() -> None:
    from engines_adapter.torch_ref import PRESETS, resolve_preset

    sizes = [PRESETS[name].num_parameters for name in ("tiny", "small", "medium", "llama-1b")]
    assert sizes == sorted(sizes)
    assert PRESETS["llama-1b"].num_parameters == 1_235_814_400  # Llama-3.2-1B's published count
    assert PRESETS["tiny"].num_parameters < 1_000_000
    with pytest.raises(ConfigError, match="num_kv_heads"):
        resolve_preset("tiny", num_kv_heads=3)
    with pytest.raises(ConfigError, match="unknown model field"):
        resolve_preset("tiny", hidden=3)
