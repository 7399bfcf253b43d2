"""House rules a reviewer would otherwise check by hand: no import circles among our packages
(jobs -> pipeline -> actors -> packing, benchmarks on top)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# actors/ joins this list (and the __new__ check below comes back) once the engine's own
# circle, actors.engine <-> actors.parallel.pipelined <-> actors.stats, is untied (issue 12,
# item 1, in progress on another branch).
PACKAGES = ("pipeline", "packing", "jobs", "benchmarks")


def _modules(packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of our packages but their __init__.py
    (a package's face only hands names on; importing it is not a dependency on each module)."""
    mods = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py":
                mods[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return mods


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (absolute imports, anywhere in the file)."""
    mods = _modules(packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t in mods and t != module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_our_imports() -> None:
    graph = import_graph()
    assert "packing.greedy" in graph["packing.optimal"]  # a plain `from packing.x import y`


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert found == [], "modules that import each other: " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_packages_never_import_benchmarks() -> None:
    graph = import_graph((*PACKAGES, "actors"))
    assert any(m.startswith("benchmarks.") for m in graph)
    wrong = [
        f"{m} imports {t}"
        for m, targets in graph.items()
        if not m.startswith("benchmarks.")
        for t in targets
        if t.startswith("benchmarks.")
    ]
    assert wrong == []
