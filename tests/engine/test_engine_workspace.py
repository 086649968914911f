"""The decode workspace is invisible in results: a batch that changes under it (requests joining,
finishing, extended, released) decodes exactly as an engine that gathers from the pool every step."""

from __future__ import annotations

import random

import numpy as np
from _engine_testkit import kv_array, torch_engine

from engines_adapter.base import SamplingParams
from engines_adapter.torch_ref import TorchRefEngine
from engines_adapter.torch_ref.workspace import HEADROOM_TOKENS


def _script(engine: TorchRefEngine) -> tuple[dict[str, list[int]], dict[str, np.ndarray]]:
    rng = random.Random(5)
    sp = [SamplingParams(seed=i, temperature=0.9, max_tokens=HEADROOM_TOKENS + 100) for i in range(4)]
    prompts = [[rng.randrange(2048) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    for i in range(3):
        engine.prefill(f"r{i}", prompts[i], sp[i])
    live = ["r0", "r1", "r2"]
    for step in range(HEADROOM_TOKENS + 60):  # long enough for the workspace to run out of room
        if step == 10:
            engine.prefill("r3", prompts[3], sp[3])
            live.append("r3")
        if step == 20:
            pending = engine.tokens("r1")[-1]
            engine.extend("r1", [pending, 17, 23])  # r1's KV moves on outside decode
        if step == 30:
            engine.release("r0")
            live.remove("r0")
        engine.decode(live)
    tokens = {r: engine.tokens(r) for r in live}
    kv = {r: kv_array(engine.export_kv(r)) for r in live}
    return tokens, kv


def test_workspace_decodes_exactly_like_pool_gathers() -> None:
    with_ws = torch_engine()
    without = torch_engine()
    without.workspace_bytes = 0
    got_tokens, got_kv = _script(with_ws)
    want_tokens, want_kv = _script(without)
    assert got_tokens == want_tokens
    for r, kv in want_kv.items():
        np.testing.assert_allclose(got_kv[r], kv, rtol=0, atol=1e-12)
    # built at the start, when r3 joined, after r1's extend, after r0 left, and when room ran out
    assert with_ws.workspace_builds == 5
    assert without.workspace_builds == 0
