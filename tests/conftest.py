"""Shared test fixtures and the rules for marked tests.

Tests marked ``root`` need root (network namespaces, TUN devices) and skip with that reason elsewhere.

vLLM servers shared across modules, because every vLLM start costs tens of seconds on a 2-core
machine: ``tiny_llama_f32`` (one tiny float32 model directory, session scope) and ``vllm_pair``
(P and MD as vLLM servers beside their sidecars, P->MD across a netlab loopback WAN, float32,
``PositionSeededSampling`` loaded, a small MD cache, each side's KV bytes dumped), started on first
use. Its users leave it as they found it: nothing held afterwards, transfer ids and prompts of
their own, counters read as before/after deltas, a cut or reshaped WAN restored; a test that kills
one of its servers runs last (a later user then gets a fresh pair). ``vllm_trio`` is the same with
RelayDecode too (P, RLD, MD; the relay and router-fault modules): a server a module
killed is started again beside its sidecar before the next module (what a supervisor does; the
sidecars reset what they held for it), so a killed vLLM costs one server's start, not three. A
module that needs its own processes keeps them. The modules that use a shared set run together at
the end of the session, the trio's first (collection order otherwise kept), so its servers live
only while they are needed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.vllm import SEEDED_SAMPLING as FQCN

SHARED_SERVERS = ("vllm_trio", "vllm_pair")  # the order their users run in
PAIR_WAN = "[link]\ndelay_ms = 5\nrate_mbit = 400\nqueue_packets = 400\n"
PAIR_MD_BLOCKS = 160  # 5120 tokens: a few 1000-token prompts evict each other


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _shared_servers_last(items)
    _skip_root(items)


def _skip_root(items: list[pytest.Item]) -> None:
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

    def uses(item: pytest.Item) -> int:
        names = getattr(item, "fixturenames", ())
        return next((k for k, f in enumerate(SHARED_SERVERS) if f in names), len(SHARED_SERVERS))

    group: dict[str, int] = {}
    for item in items:
        group[module(item)] = min(group.get(module(item), len(SHARED_SERVERS)), uses(item))
    last = len(SHARED_SERVERS)
    items[:] = [i for i in items if group[module(i)] == last] + sorted(
        (i for i in items if group[module(i)] < last), key=lambda i: group[module(i)]
    )


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


def _running(proc: Any) -> bool:
    return proc is not None and proc.poll() is None


class SharedPair:
    """The shared pair (``relay``: trio) and its WAN, started on first use. The pair is started
    afresh when a module left one of its servers dead (a fault test that kills MD's vLLM runs last,
    but another order still works); the trio starts a dead server again beside its sidecar, and
    starts afresh only when a sidecar is gone."""

    def __init__(self, model: Path, relay: bool = False) -> None:
        self.model = model
        self.relay = relay
        self.pair: Any = None
        self.lab: Any = None
        self.root: Path | None = None

    def get(self) -> Any:
        if self.pair is not None and self.relay and all(_running(s.proc) for s in self.pair.sides().values()):
            dead = [s for s in self.pair.servers().values() if not _running(s.proc)]
            for server in dead:
                server.start()
            for server in dead:
                server.wait_ready(300)
            return self.pair
        if self.pair is not None and all(s.proc.poll() is None for s in (self.pair.p, self.pair.md)):
            return self.pair
        self.close()
        import vllm.distributed.kv_events  # noqa: F401  (before the sidecars' loop imports it)

        from harness.vllm.pair import PairSpec, VllmPair
        from netlab import Lab
        from netlab.profile import parse_profile

        self.root = root = Path(tempfile.mkdtemp(prefix="pddlink-vp-"))  # sockets: keep the path short
        (root / "dump").mkdir()
        name = "vtrio" if self.relay else "vpair"
        profile = parse_profile(PAIR_WAN, name=name)
        self.lab = lab = Lab.up(profile, name=f"{name}{os.getpid() % 100000}", mode="loopback")
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
            relay=self.relay,
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


@pytest.fixture(scope="session")
def shared_trio(tiny_llama_f32: Path) -> Iterator[SharedPair]:
    pytest.importorskip("vllm", reason="vLLM is not installed here (pip install 'pddlink[vllm]')")
    holder = SharedPair(tiny_llama_f32, relay=True)
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture(scope="module")
def vllm_trio(shared_trio: SharedPair) -> Any:
    """P, RelayDecode and MD (``VllmTrio``): ``vllm_pair``'s servers and WAN with RLD beside P
    (its KV on loopback, the fast path); a server a module killed is started again before the
    next module's first use."""
    return shared_trio.get()


@pytest.fixture(scope="module")
def vllm_pair(shared_pair: SharedPair, shared_trio: SharedPair) -> Any:
    """P and MD (``harness.vllm.pair.VllmPair``), P's sidecar dialling MD's across a netlab
    loopback WAN (``pair.lab``: 5 ms one way, 400 Mbit/s; a test that reshapes or cuts it restores
    it), MD's cache small enough to evict (``PAIR_MD_BLOCKS``), ``spec.kv_dump_dir`` holding the KV
    bytes each side's connector held. A landed slot nobody loads (a dead MD URL, a killed vLLM) is
    swept after 5 s."""
    shared_trio.close()  # its users ran before (``_shared_servers_last``): free its servers
    return shared_pair.get()
