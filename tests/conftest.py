"""Shared test fixtures and the rules for marked tests.

Tests marked ``root`` need root (network namespaces, TUN devices) and skip with that reason elsewhere.

vLLM servers shared across modules, because every vLLM start costs tens of seconds on a 2-core
machine: ``tiny_llama_f32`` (one tiny float32 model directory, session scope) and ``vllm_pair``
(P and MD as vLLM servers beside their sidecars, P->MD across a netlab loopback WAN, float32,
``PositionSeededSampling`` loaded, a small MD cache, each side's KV bytes dumped), started on first
use. Its users leave it as they found it: nothing held afterwards, transfer ids and prompts of
their own, counters read as before/after deltas, a cut or reshaped WAN restored; a test that kills
one of its servers runs last (a later user then gets a fresh pair). A module whose servers differ
(the relay trio) or that needs its own processes keeps them. The modules that use the pair run
together at the end of the session (collection order otherwise kept), so its servers live only
while they are needed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FQCN = "engines_adapter.vllm.sampling:PositionSeededSampling"
SHARED_SERVERS = ("vllm_pair",)
PAIR_WAN = "[link]\ndelay_ms = 5\nrate_mbit = 400\nqueue_packets = 400\n"
PAIR_MD_BLOCKS = 160  # 5120 tokens: a few 1000-token prompts evict each other


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _shared_servers_last(items)
    if os.geteuid() == 0:
        return
    skip_root = pytest.mark.skip(reason="needs root: network namespaces and TUN devices")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip_root)


def _shared_servers_last(items: list[pytest.Item]) -> None:
    """Whole modules that use a shared server set move to the end, in their order (a module's own
    fixtures are then set up once)."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    users = {module(i) for i in items if any(f in getattr(i, "fixturenames", ()) for f in SHARED_SERVERS)}
    items[:] = [i for i in items if module(i) not in users] + [i for i in items if module(i) in users]


@pytest.fixture(scope="session")
def tiny_llama_f32() -> Iterator[Path]:
    """The tiny random Llama in float32 (``harness.vllm.tiny_model``), built once."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="pddlink-tiny-"))
    try:
        yield build_tiny_llama(root / "model", TinyLlamaSpec(dtype="float32"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


class SharedPair:
    """The shared pair and its WAN, started on first use; started afresh when a module left one of
    its servers dead (a fault test that kills MD's vLLM runs last, but another order still works)."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.pair: Any = None
        self.lab: Any = None
        self.root: Path | None = None

    def get(self) -> Any:
        if self.pair is not None and all(s.proc.poll() is None for s in (self.pair.p, self.pair.md)):
            return self.pair
        self.close()
        import vllm.distributed.kv_events  # noqa: F401  (before the sidecars' loop imports it)

        from harness.vllm.pair import PairSpec, VllmPair
        from netlab import Lab
        from netlab.profile import parse_profile

        self.root = root = Path(tempfile.mkdtemp(prefix="pddlink-vp-"))  # sockets: keep the path short
        (root / "dump").mkdir()
        profile = parse_profile(PAIR_WAN, name="vpair")
        self.lab = lab = Lab.up(profile, name=f"vpair{os.getpid() % 100000}", mode="loopback")
        spec = PairSpec(
            root / "w",
            self.model,
            dtype="float32",
            # "tiny" too: the OpenAI conformance test holds the router's answers against P's own
            extra_args=("--logits-processors", FQCN, "--served-model-name", str(self.model), "tiny"),
            kv_dump_dir=root / "dump",
            md_num_blocks=PAIR_MD_BLOCKS,
            md_orphan_s=5.0,
            wan=lambda port: "{}:{}".format(*lab.endpoint("dc-b", port)),
        )
        self.pair = VllmPair(spec)
        self.pair.lab = lab  # type: ignore[attr-defined]
        self.pair.start()
        return self.pair

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
        if self.lab is not None:
            self.lab.down()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.pair = self.lab = self.root = None


@pytest.fixture(scope="session")
def shared_pair(tiny_llama_f32: Path) -> Iterator[SharedPair]:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    holder = SharedPair(tiny_llama_f32)
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture(scope="module")
def vllm_pair(shared_pair: SharedPair) -> Any:
    """P and MD (``harness.vllm.pair.VllmPair``), P's sidecar dialling MD's across a netlab
    loopback WAN (``pair.lab``: 5 ms one way, 400 Mbit/s; a test that reshapes or cuts it restores
    it), MD's cache small enough to evict (``PAIR_MD_BLOCKS``), ``spec.kv_dump_dir`` holding the KV
    bytes each side's connector held. A landed slot nobody loads (a dead MD URL, a killed vLLM) is
    swept after 5 s."""
    return shared_pair.get()
