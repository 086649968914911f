"""The gRPC modules are a build product: generated with their type stubs by ``python -m pddlink.serving.rpc``,
checked (by content) but never generated when the package is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from pddlink.errors import Unavailable
from pddlink.serving import rpc


def test_generate_writes_modules_stubs_and_a_content_stamp(tmp_path: Path) -> None:
    rpc.generate(tmp_path)
    for proto in rpc.PROTOS:
        stem = proto.stem
        for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py", f"{stem}_pb2_grpc.pyi"):
            assert (tmp_path / name).stat().st_size > 0, name
        assert f"from . import {stem}_pb2 as" in (tmp_path / f"{stem}_pb2_grpc.py").read_text()
        assert not rpc.stale(proto, tmp_path)
    (tmp_path / f"{rpc.PROTO.stem}.sha256").write_text("0" * 64)  # as if the .proto had changed
    assert rpc.stale(rpc.PROTO, tmp_path)


def test_missing_modules_are_an_error_that_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rpc, "GEN_DIR", tmp_path)
    with pytest.raises(Unavailable, match=r"python -m pddlink\.serving\.rpc"):
        rpc.require_generated()
    assert list(tmp_path.iterdir()) == []  # nothing was generated on the way
