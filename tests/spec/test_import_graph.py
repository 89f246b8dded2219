"""The engine and the drafters meet only in ``toolspec_core.spec``: read from the source (every
import statement, function-level ones included), the engine imports no drafter module, the spec
imports neither, and the package graph of ``toolspec_core`` has no cycle through the drafters or
the spec (the engine and the model still import each other: the step runner reads the engine's
device walk)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "toolspec_core"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved against its package)."""
    pkg = ".".join(("toolspec_core",) + path.relative_to(ROOT).parent.parts)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # ``from pkg import module``
    return out


def package_edges() -> dict[str, set[str]]:
    """``toolspec_core`` subpackage -> the subpackages its modules import."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2:
            continue
        src = rel[0]
        for mod in imported_modules(path):
            parts = mod.split(".")
            if parts[0] == "toolspec_core" and len(parts) > 1 and parts[1] != src:
                edges.setdefault(src, set()).add(parts[1])
    return edges


def test_the_engine_imports_no_drafter_and_the_spec_imports_neither():
    edges = package_edges()
    assert "drafters" not in edges.get("engine", set())
    assert not edges.get("spec", set()) & {"engine", "drafters"}
    assert "spec" in edges["engine"] and "spec" in edges["drafters"]  # both meet there


def test_no_cycle_through_the_engine_and_the_drafters():
    edges = package_edges()

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            x = todo.pop()
            for y in edges.get(x, ()):
                if y == b:
                    return True
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return False

    assert not reaches("engine", "drafters")  # not through model or anything else either
    for pkg in ("drafters", "spec"):
        assert not reaches(pkg, pkg), pkg


def test_the_reader_sees_function_level_imports():
    src = ROOT / "engine" / "grammar.py"  # imports the layouts inside a function
    assert "toolspec_core.spec.layouts" in imported_modules(src)
