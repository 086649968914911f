"""The pure layers import no I/O: no asyncio, sockets, grpc or torch (DESIGN.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_PACKAGES = ["wire", "kv", "drc", "transfer", "handoff", "routing", "lifecycle"]
FORBIDDEN = {
    *("asyncio", "socket", "ssl", "selectors", "subprocess"),
    *("grpc", "torch", "uvloop", "aioquic", "qh3"),
    *("sidecar", "netlab"),  # the pure layers sit below the daemon and the lab
}


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_package_imports_no_io(package: str) -> None:
    files = sorted((ROOT / "pddlink" / package).rglob("*.py"))
    assert files, f"pddlink/{package} has no modules"
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_roots(f) & FORBIDDEN) for f in files}
    offenders = {f: names for f, names in offenders.items() if names}
    assert not offenders, f"pure modules import I/O libraries: {offenders}"


def test_checker_sees_forbidden_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncio\nfrom torch import nn\nfrom . import sibling\n")
    assert _imported_roots(bad) & FORBIDDEN == {"asyncio", "torch"}
