"""``trio_across_lab(...)``: a ``VllmTrio`` (``harness.vllm.pair``) whose P->MD leg crosses
a loopback netlab WAN of its own (``trio.lab``), ``PositionSeededSampling`` loaded: the set-up the
relay and router-fault tests and ``pddlink bench vllm-exact`` share. Here, not beside ``VllmTrio``:
the engine adapters do not import the lab (tests/foundation/test_layering)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.vllm import SEEDED_SAMPLING
from harness.vllm.pair import PairSpec, VllmPair, VllmTrio


@contextlib.contextmanager
def trio_across_lab(workdir: Path, model: Path, link: str, name: str, **spec: Any) -> Iterator[VllmPair]:
    """P, RLD and MD (float32, ``PositionSeededSampling`` loaded), P's sidecar dialling MD's KV port
    across a loopback netlab lab whose link is ``link`` (a profile's text); ``trio.lab`` is the lab.
    ``spec``: the other ``PairSpec`` fields. Both are gone when the block ends."""
    from netlab import Lab
    from netlab.profile import parse_profile

    lab = Lab.up(parse_profile(link, name=name), name=f"{name}{os.getpid() % 100000}", mode="loopback")
    try:
        trio = VllmTrio(
            PairSpec(
                workdir,
                model,
                dtype="float32",
                extra_args=("--logits-processors", SEEDED_SAMPLING),
                wan=lambda port: "{}:{}".format(*lab.endpoint("dc-b", port)),
                **spec,
            )
        )
        trio.lab = lab  # type: ignore[attr-defined]
        try:
            trio.start()
            yield trio
        finally:
            trio.close()
    finally:
        lab.down()
