"""No import cycles among kvcache's modules.

Every import that runs is an edge: at module level or inside a function, absolute or relative;
imports under ``if TYPE_CHECKING:`` are not (they never run). ``from pkg import name`` is an edge
to ``pkg.name`` when that is a module, else to ``pkg``. A module's imports of its own parent
packages are not edges (Python has already started them), nor are the parent packages a
submodule import starts implicitly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvcache


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package whose folder is ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` (or ``if typing.TYPE_CHECKING:``) bodies."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (its file at ``path``) imports when it runs."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for a in node.names:
                found.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
    return {t for t in found if t in modules and t != name and not name.startswith(t + ".")}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
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
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        path, seen = [start], {start: 0}
        while True:  # follow edges inside the group until a module repeats
            nxt = min(w for w in graph[path[-1]] if w in group)
            if nxt in seen:
                out.append(path[seen[nxt]:] + [nxt])
                break
            seen[nxt] = len(path)
            path.append(nxt)
    return sorted(out)


def test_kvcache_has_no_import_cycles():
    root = Path(kvcache.__file__).parent
    graph = import_graph(root)
    assert "kvcache.cliargs" in graph["kvcache.cli"]  # the walk sees the package's imports
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walk_finds_a_planted_cycle_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.c import C\n")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")  # runs when f is called: an edge
    (pkg / "sub" / "c.py").write_text("import pkg.a\nC = 1\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n")
    (pkg / "e.py").write_text("import pkg.d\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
