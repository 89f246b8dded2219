"""The repository's import graph, read from the source: every import statement of a module -- at
the top, inside a function, under ``if TYPE_CHECKING`` (a lazy or a type-only import is still a
dependency) -- resolved to the modules it names, and the cycles of that graph with the import
lines that close them. The import tests (``test_imports``, ``spec/test_import_graph``) share it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules_under(folder: Path, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` below ``folder`` (named from ``root``; a
    package's ``__init__.py`` is the package's name)."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@dataclass(frozen=True)
class Import:
    """One import statement: the module it names (relative imports resolved), the names it takes
    from it (empty for ``import m``), and its line."""

    module: str
    names: tuple[str, ...]
    line: int


def import_statements(name: str, path: Path) -> list[Import]:
    """Every import statement of the module ``name`` (its source at ``path``), in source order."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = package.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
            out.append(Import(mod, tuple(a.name for a in node.names), node.lineno))
    return sorted(out, key=lambda i: i.line)


def imports_of(name: str, path: Path) -> set[str]:
    """Every dotted name ``path`` imports: each module named, and ``module.name`` for each name
    taken from it (``from pkg import module`` names a module that way)."""
    found = set()
    for imp in import_statements(name, path):
        found.add(imp.module)
        found.update(f"{imp.module}.{n}" for n in imp.names)
    return found


# module -> {module it imports: the line of the first statement that does}
Graph = dict[str, dict[str, int]]


def module_graph(mods: dict[str, Path]) -> Graph:
    """The import edges between the modules of ``mods``: ``from pkg import sub`` is an edge to the
    module ``pkg.sub`` when there is one (the package is only passed through), else to ``pkg``."""
    edges: Graph = {}
    for name, path in mods.items():
        out = edges.setdefault(name, {})
        for imp in import_statements(name, path):
            subs = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in mods]
            targets = subs if subs and len(subs) == len(imp.names) else subs + [imp.module]
            for t in targets:
                if t in mods and t != name:
                    out.setdefault(t, imp.line)
    return edges


def part_of(module: str, package: str) -> str | None:
    """The direct child of ``package`` (a module or a whole subpackage) that ``module`` lies in;
    None for the package's own ``__init__`` and for modules outside it."""
    if not module.startswith(package + "."):
        return None
    return package + "." + module[len(package) + 1 :].split(".")[0]


def parts_graph(edges: Graph, package: str) -> dict[str, dict[str, tuple[str, str, int]]]:
    """The graph between the direct children of ``package``, each subpackage one node: child ->
    {child it imports: the first module edge that makes it, as (importer, imported, line)}."""
    out: dict[str, dict[str, tuple[str, str, int]]] = {}
    for src in sorted(edges):
        a = part_of(src, package)
        if a is None:
            continue
        out.setdefault(a, {})
        for dst, line in sorted(edges[src].items()):
            b = part_of(dst, package)
            if b is not None and b != a:
                out[a].setdefault(b, (src, dst, line))
    return out


def packages_in(mods: dict[str, Path]) -> list[str]:
    """The packages (folders with an ``__init__.py``) among ``mods``."""
    return sorted(n for n, p in mods.items() if p.name == "__init__.py")


def _components(nodes: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``nodes`` with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(nodes.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(found)


def cycles(edges: dict) -> list[list[str]]:
    """One shortest cycle through each knot of ``edges`` (node -> the nodes it imports), as the
    node path ``[a, b, ..., a]``; an acyclic graph gives ``[]``."""
    nodes = {a: set(bs) for a, bs in edges.items()}
    out = []
    for comp in _components(nodes):
        start, inside = comp[0], set(comp)
        came: dict[str, str] = {}
        todo = [start]
        while todo and start not in came:  # breadth first, back to the start
            nxt = []
            for a in todo:
                for b in sorted(nodes.get(a, ()) & inside):
                    if b not in came:
                        came[b] = a
                        nxt.append(b)
            todo = nxt
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came[path[-1]])
        out.append(path[::-1])
    return out


def describe(cycle: list[str], edges: dict) -> str:
    """A cycle with the import that makes each of its steps, for a failure message."""
    steps = [cycle[0]]
    for a, b in zip(cycle, cycle[1:]):
        how = edges[a][b]
        if isinstance(how, tuple):  # a parts graph: the module edge behind the step
            src, dst, line = how
            steps.append(f"-> {b}  ({src} line {line} imports {dst})")
        else:
            steps.append(f"-> {b}  (line {how})")
    return "\n    ".join(steps)
