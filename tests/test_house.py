"""House rules a reviewer would otherwise check by hand: no import circles among our packages
(jobs -> pipeline -> actors -> packing, benchmarks on top), one prefix-group type."""

from __future__ import annotations

import ast
import re
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


# A class named like a prefix group: "prefix" and "group" in either order (PrefixGroupState),
# or a name ending in a single Group (PlannedGroup); a collection (ShardGroups) is not one.
GROUP_LIKE = re.compile(r"(?i)prefix\w*group|group\w*prefix|^\w*Group$")


def group_like_classes(packages: tuple[str, ...]) -> list[tuple[str, str]]:
    """(file, class) for every class named like a prefix group or holding a prefix group's
    fields (`prefix_len` or `members` annotated in its body)."""
    found = []
    for path, tree in _trees(packages):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            fields = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            if GROUP_LIKE.search(node.name) or fields & {"prefix_len", "members"}:
                found.append((path.relative_to(ROOT).as_posix(), node.name))
    return found


def _trees(packages: tuple[str, ...]) -> list[tuple[Path, ast.Module]]:
    paths = [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))]
    return [(p, ast.parse(p.read_text(), str(p))) for p in paths]


def test_the_group_finder_knows_the_old_shapes() -> None:
    names = ["PrefixGroup", "PrefixGroupState", "PlannedGroup", "GroupOfPrefixes"]
    assert all(GROUP_LIKE.search(n) for n in names)
    assert not any(GROUP_LIKE.search(n) for n in ["ShardGroups", "SharedPrefixState", "Stage"])


def test_one_prefix_group_type() -> None:
    """A group of prompts that share a prefix has one type, `packing.PrefixGroup`, across the
    packages (issue 12 item 3); the engine's runtime state of one is `SharedPrefixState`."""
    assert group_like_classes(("packing", "pipeline", "actors")) == [
        ("packing/prefix.py", "PrefixGroup")
    ]
