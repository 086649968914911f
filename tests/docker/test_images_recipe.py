"""What the image is built from, checked without an engine: the pinned wheel closure (this machine's
versions, a CPU torch, no development tools), the Debian source and the base image's tag."""

from __future__ import annotations

import re

from netlab.compose import images


def test_pins_are_the_runtime_closure_with_a_cpu_torch_and_no_dev_tools() -> None:
    pins = dict(p.split("==") for p in images.pinned_requirements())
    assert pins["torch"].endswith("+cpu")
    for needed in ("click", "grpcio", "protobuf", "aioquic", "qh3", "zstandard", "xxhash", "numpy"):
        assert needed in pins, needed
    for dev in ("pytest", "ruff", "mypy", "hypothesis", "grpcio-tools", "transformers"):
        assert dev not in pins, dev
    assert all(re.fullmatch(r"[a-z0-9-]+", name) for name in pins)


def test_the_base_image_tag_names_the_release_and_changes_with_its_recipe(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    release, mirror = images.debian_source()
    assert release and mirror.startswith(("http://", "https://", "file:/"))
    tag = images.base_tag()
    assert tag.startswith(f"pddlink-base:{release}-") and images.base_tag() == tag
    monkeypatch.setattr(images, "BASE_PACKAGES", (*images.BASE_PACKAGES, "curl"))
    assert images.base_tag() != tag
