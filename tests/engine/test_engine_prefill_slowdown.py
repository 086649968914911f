"""``prefill_slowdown``: a decode-leaning chip, emulated. Prefill and extend passes hold the engine
``k - 1`` times their own duration longer; decode steps are untouched; the tokens are the same."""

from __future__ import annotations

import time

import pytest

from engines_adapter.base import SamplingParams
from engines_adapter.torch_ref import TorchRefEngine
from pddlink.errors import ConfigError
from sidecar.config import EngineConfig
from tests.engine._engine_testkit import SEED, small_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def engine(slowdown: float) -> TorchRefEngine:
    return TorchRefEngine(small_config(), dtype="float64", seed=SEED, block_size=4, num_blocks=512,
                          prefill_slowdown=slowdown)  # fmt: skip


def run(e: TorchRefEngine) -> list[int]:
    first = e.prefill("r", list(range(1, 65)), GREEDY).token_id
    second = e.extend("r", [first, 7, 9]).token_id
    return [first, second, *(o.token_id for o in e.decode(["r"]))]


def test_prefill_and_extend_sleep_k_minus_one_times_their_pass_decode_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = run(engine(1.0))
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    slow = engine(3.0)
    assert run(slow) == plain  # the same tokens, later
    assert len(slept) == 2 and all(s > 0 for s in slept)  # the prefill and the extend, not the decode
    started = time.perf_counter()
    slow.decode(["r"])
    slow.prefill("q", list(range(2, 40)), GREEDY)
    pass_s = time.perf_counter() - started
    assert len(slept) == 3 and 0 < slept[-1] <= 2.0 * pass_s  # (k - 1) x a pass no longer than this


def test_a_slowdown_below_one_or_absurd_is_refused() -> None:
    for bad in (0.5, 101.0):
        with pytest.raises(ConfigError):
            engine(bad)
        with pytest.raises(ConfigError):
            EngineConfig(prefill_slowdown=bad)
