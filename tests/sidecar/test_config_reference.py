"""The TOML reference (docs/config-reference.md) lists every key of every config dataclass."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness import config_reference as ref
from pddlink.serving.client_guard import ApiConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def test_every_key_has_a_meaning() -> None:
    assert ref.missing() == []


def test_committed_reference_is_current() -> None:
    assert DOC.read_text() == ref.render(), (
        "regenerate: python -m harness.config_reference > docs/config-reference.md"
    )


def test_a_new_key_without_a_meaning_is_caught() -> None:
    grown = dataclasses.make_dataclass(
        "Grown", [("brand_new_s", float, dataclasses.field(default=1.0))], bases=(ApiConfig,), frozen=True
    )
    with pytest.raises(KeyError, match=r"api\.brand_new_s"):
        ref.rows("api", grown)
    ref.TABLES.append(("api", grown))
    try:
        assert ref.missing() == ["api.brand_new_s"]
    finally:
        ref.TABLES.pop()


def test_reference_shows_type_and_default() -> None:
    text = DOC.read_text()
    assert "| `max_body_bytes` | int | `1048576` |" in text
    assert '| `wan_transport` | str | `"tcp"` |' in text
    assert "| `relay_enabled` | bool | `true` |" in text
