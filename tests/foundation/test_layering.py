"""Layering: the pure layers import no I/O (no asyncio, sockets, grpc or torch; DESIGN.md, "Layout"),
the packages import each other in the agreed directions, and no modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_PACKAGES = ["wire", "kv", "drc", "transfer", "handoff", "routing", "lifecycle"]
FORBIDDEN = {
    *("asyncio", "socket", "ssl", "selectors", "subprocess"),
    *("grpc", "torch", "uvloop", "aioquic", "qh3"),
    *("sidecar", "router", "harness", "netlab"),  # the pure layers sit below the services and the lab
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


# -- directions between the project's packages, and no import circles ------------------------------

PROJECT = ["pddlink", "sidecar", "router", "harness", "engines_adapter", "netlab"]


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PROJECT:
        for f in (ROOT / pkg).rglob("*.py"):
            if "proto_gen" in f.parts:
                continue
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _runtime_imports(path: Path) -> set[str]:
    """Every module named by an import (also inside functions), except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = {d for d in _runtime_imports(path) if d in mods and d != name}
        graph[name] = {d for d in deps if not name.startswith(d + ".")}  # a parent package runs first
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circles_among_the_projects_modules() -> None:
    assert _cycles(_graph()) == []


def test_the_circle_finder_sees_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for name, path in _modules().items():
        if name == package or name.startswith(package + "."):
            bad = sorted(
                d for d in _runtime_imports(path) if d.split(".")[0] in forbidden or d.startswith(forbidden)
            )
            if bad:
                out[name] = bad
    return out


def test_the_sidecar_imports_neither_the_lab_nor_the_simulator_nor_the_router() -> None:
    assert _offenders("sidecar", ("netlab", "pddlink.sim", "router", "harness")) == {}


def test_the_router_and_the_engine_adapters_do_not_import_the_lab_or_the_harness() -> None:
    assert _offenders("router", ("netlab", "pddlink.sim", "harness")) == {}
    assert _offenders("engines_adapter", ("netlab", "pddlink.sim", "harness", "router")) == {}


def test_the_transport_does_not_import_the_lab() -> None:
    assert _offenders("pddlink.transport", ("netlab", "sidecar", "router", "harness")) == {}
