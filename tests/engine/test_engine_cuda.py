"""The reference engine on CUDA gives the tokens it gives on the CPU (float64); skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from _engine_testkit import SEED, generate_alone, small_config

from engines_adapter.base import SamplingParams
from engines_adapter.torch_ref import TorchRefEngine
from pddlink.errors import Unavailable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@needs_cuda
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(max_tokens=12), SamplingParams(seed=5, temperature=1.0, top_k=50, max_tokens=12)],
)
def test_cuda_matches_cpu_and_moves_kv_between_them(sampling: SamplingParams) -> None:
    cpu = TorchRefEngine(small_config(), dtype="float64", seed=SEED, block_size=4, num_blocks=256)
    gpu = TorchRefEngine(
        small_config(), dtype="float64", seed=SEED, block_size=4, num_blocks=256, device="cuda"
    )
    prompt = list(range(200, 270))
    expected = generate_alone(cpu, "r", prompt, sampling)
    first = gpu.prefill("g", prompt, sampling)
    gpu_kv = gpu.export_kv("g")
    cpu.import_kv("from-gpu", prompt, [gpu_kv], sampling)  # KV bytes cross devices unchanged
    assert cpu.extend("from-gpu", [first.token_id]).token_id == expected[len(prompt) + 1]
    out = first
    while not out.finished:
        out = gpu.decode(["g"])[0]
    assert gpu.tokens("g") == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_device_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="CUDA"):
        TorchRefEngine("tiny", device="cuda")
