"""The engine and the drafters meet only in ``toolspec_core.spec``: read from the source (every
import statement, function-level ones included, by ``import_graph``), the engine imports no
drafter module, the spec imports neither, and nothing the engine imports leads to the drafters.
(No cycle between the core's subpackages is ``test_imports``' business.)"""

from __future__ import annotations

from import_graph import ROOT, imports_of, module_graph, modules_under, parts_graph

CORE = ROOT / "toolspec_core"


def package_edges() -> dict[str, set[str]]:
    """``toolspec_core`` subpackage -> the subpackages its modules import."""
    parts = parts_graph(module_graph(modules_under(CORE)), "toolspec_core")
    return {a.split(".")[1]: {b.split(".")[1] for b in bs} for a, bs in parts.items()}


def test_the_engine_imports_no_drafter_and_the_spec_imports_neither():
    edges = package_edges()
    assert "drafters" not in edges.get("engine", set())
    assert not edges.get("spec", set()) & {"engine", "drafters"}
    assert "spec" in edges["engine"] and "spec" in edges["drafters"]  # both meet there


def test_nothing_the_engine_imports_leads_to_the_drafters():
    edges = package_edges()
    seen, todo = set(), ["engine"]
    while todo:
        for y in edges.get(todo.pop(), ()):
            if y not in seen:
                seen.add(y)
                todo.append(y)
    assert "model" in seen and "drafters" not in seen  # not through the model or anything else


def test_the_reader_sees_function_level_imports():
    src = CORE / "engine" / "grammar.py"  # imports the layouts inside a function
    assert "toolspec_core.spec.layouts" in imports_of("toolspec_core.engine.grammar", src)
