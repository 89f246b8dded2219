"""The installed packages' import graph (read by ``import_graph``, every import statement counted):
no cycle between modules, nor between the parts of any package; the core imports nothing from the
layers above it nor their heavy dependencies, every core module imports on its own, and the public
API resolves; and no product module or test imports a study (``benchmarks/studies``: not
installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from import_graph import (
    ROOT,
    cycles,
    describe,
    imports_of,
    module_graph,
    modules_under,
    packages_in,
    parts_graph,
)

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
# the installed packages whose import graph has no cycle
PRODUCT = ("toolspec_core", "deployments", "retrieval_service")


def core_modules() -> dict[str, Path]:
    return modules_under(CORE)


def product_modules() -> dict[str, Path]:
    mods = {}
    for top in PRODUCT:
        mods.update(modules_under(ROOT / top))
    return mods


def knots(edges) -> str:
    """Every cycle of ``edges``, each with the import lines that close it (the failure message)."""
    return "\n".join(describe(c, edges) for c in cycles(edges))


def test_the_cycle_finder_sees_each_knot_and_its_path():
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {"e": 5}, "e": {"d": 6}, "f": {"a": 7}}
    assert cycles(edges) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert describe(["d", "e", "d"], edges) == "d\n    -> e  (line 5)\n    -> d  (line 6)"
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycle_between_modules():
    """No module of the installed packages imports itself back through others -- within the core,
    within ``deployments`` (``deployments/tp`` counted as its modules), within the retrieval service
    and across them."""
    edges = module_graph(product_modules())
    assert sum(map(len, edges.values())) > 100  # the graph was read
    if cycles(edges):
        pytest.fail("import cycles:\n" + knots(edges))


@pytest.mark.parametrize("package", [p for p in packages_in(product_modules()) if p != "deployments"])
def test_no_import_cycle_between_the_parts_of_a_package(package):
    """Within each package, its direct children -- modules, and each subpackage as one part -- import
    each other in one direction only: ``toolspec_core``'s subpackages, the drafters' modules and
    ``drafters.toolcall``, and so on down. (``deployments`` is held module by module, above: its
    ``tp`` subpackage is a set of modules, not one layer.)"""
    edges = parts_graph(module_graph(product_modules()), package)
    if cycles(edges):
        pytest.fail("import cycles:\n" + knots(edges))


def test_the_graph_checks_find_a_cycle_in_a_package(tmp_path):
    """A package written here: ``a`` imports ``b`` inside a function and ``b`` imports ``a`` under
    ``TYPE_CHECKING`` (a module cycle); ``sub.x`` imports ``c`` and ``c`` takes ``sub.y`` by
    ``from .sub import y`` (no module cycle, but ``sub`` and ``c`` import each other)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "c.py": "from .sub import y\n",
        "sub/__init__.py": "",
        "sub/x.py": "import pkg.c\n",
        "sub/y.py": "X = 1\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges = module_graph(modules_under(pkg, root=tmp_path))
    assert edges["pkg.c"] == {"pkg.sub.y": 1}  # the module taken from the package, not the package
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert knots(edges) == "pkg.a\n    -> pkg.b  (line 2)\n    -> pkg.a  (line 3)"
    parts = parts_graph(edges, "pkg")
    assert cycles(parts) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub", "pkg.c"]]
    assert "(pkg.sub.x line 1 imports pkg.c)" in knots(parts)
    assert cycles(parts_graph(edges, "pkg.sub")) == []


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
    src.write_text(f"from .studies import cluster_run\nimport {STUDIES}.tp_handover\n")
    found = imports_of("benchmarks.m", src)
    assert {f"{STUDIES}.cluster_run", f"{STUDIES}.tp_handover"} <= found


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
