"""The core's import graph: no cycle between its modules, nothing from the layers above it, every
module importable on its own, and the public API resolves; and no product module or test imports a
study (``benchmarks/studies``: not installed)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "toolspec_core"
# what the engine may never import: the serving / retrieval / benchmark layers and their heavy dependencies
FORBIDDEN = (
    "deployments",
    "benchmarks",
    "retrieval_service",
    "ray",
    "qdrant_client",
    "qdrant_edge",
    "deepspeed",
    "fastapi",
)


STUDIES = "benchmarks.studies"
# where a study may never be imported from: the installed packages and the suite
PRODUCT_AND_TESTS = ("toolspec_core", "deployments", "retrieval_service", "benchmarks", "tests")


def core_modules() -> dict[str, Path]:
    return modules_under(CORE)


def modules_under(folder: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` below ``folder`` (named from the repository root)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (a lazy import is still an edge)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # "from pkg import module"
    return found


def graph() -> dict[str, set[str]]:
    mods = core_modules()
    return {name: {m for m in imports_of(name, path) if m in mods and m != name} for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (cyc := visit(m)):
                return cyc
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(edges):
        if n not in state and (cyc := visit(n)):
            return cyc
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_inside_the_core():
    edges = graph()
    edges.pop("toolspec_core", None)  # the public API names modules lazily, by string
    assert len(edges) > 30
    assert find_cycle(edges) is None


def test_the_core_imports_nothing_above_it():
    bad = {}
    for name, path in core_modules().items():
        hits = sorted(m for m in imports_of(name, path) if m.split(".")[0] in FORBIDDEN)
        if hits:
            bad[name] = hits
        text = path.read_text()
        bad.update({name: [f"string {f!r}"] for f in FORBIDDEN[:3] if f'"{f}.' in text or f"'{f}." in text})
    assert not bad


def test_no_product_module_or_test_imports_a_study():
    mods = {}
    for top in PRODUCT_AND_TESTS:
        mods.update(modules_under(ROOT / top))
    mods = {name: path for name, path in mods.items() if not (name + ".").startswith(STUDIES + ".")}
    assert "benchmarks.runner" in mods and "tests.test_imports" in mods
    bad = {}
    for name, path in mods.items():
        hits = sorted(m for m in imports_of(name, path) if (m + ".").startswith(STUDIES + "."))
        text = path.read_text()  # a module named in a string (importlib, a CLI table) is an import too
        hits += [f"string {q}{STUDIES}." for q in "\"'" if f"{q}{STUDIES}." in text]
        if hits:
            bad[name] = hits
    assert not bad


def test_the_import_checks_see_a_study_import(tmp_path):
    """``imports_of`` resolves absolute and relative imports of the studies package."""
    src = tmp_path / "m.py"
    src.write_text(f"from .studies import regions\nimport {STUDIES}.copy_bound\n")
    found = imports_of("benchmarks.m", src)
    assert {f"{STUDIES}.regions", f"{STUDIES}.copy_bound"} <= found


def test_every_core_module_imports_on_its_own():
    """Each module is imported in a fresh module table (torch stays loaded): an order-dependent
    import, or a cycle that only a lazy import hid, fails here."""
    code = (
        "import importlib, sys, traceback\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import torch, transformers\n"
        f"names = {sorted(core_modules())!r}\n"
        "bad = []\n"
        "for n in names:\n"
        "    for k in [k for k in sys.modules if k == 'toolspec_core' or k.startswith('toolspec_core.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception:\n"
        "        bad.append(n + ': ' + traceback.format_exc(limit=2))\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]


def test_the_drafter_protocol_loads_no_model_code():
    """A drafter is written against ``drafters.base`` (the protocol, the step context, the tree and
    the verify result it learns from) without the target: importing it loads no ``model`` module."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import toolspec_core.drafters.base\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('toolspec_core.'))))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = res.stdout.split()
    assert "toolspec_core.drafters.base" in loaded and "toolspec_core.spec.tree" in loaded
    assert not [m for m in loaded if m == "toolspec_core.model" or m.startswith("toolspec_core.model.")]


def test_public_api_resolves():
    import toolspec_core

    for name in toolspec_core.__all__:
        assert getattr(toolspec_core, name) is not None, name
    with pytest.raises(AttributeError):
        toolspec_core.no_such_name  # noqa: B018
