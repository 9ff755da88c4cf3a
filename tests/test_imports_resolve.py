"""Every name a test imports from kvcache exists, including in the tests that skip here (those that
need llama.cpp's tools, a GPU, the Qwen file): a function removed from the package shows up in this
run, not only on the machine that has the peer."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

TESTS = Path(__file__).parent


def _kvcache_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of every ``from kvcache... import name`` under tests/."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvcache":
                found += [(path.name, node.lineno, node.module, a.name) for a in node.names]
    return found


def test_every_name_a_test_imports_from_kvcache_exists():
    imports = _kvcache_imports()
    assert len(imports) > 100 and any(m == "kvcache.eval.weights" for _, _, m, _ in imports)
    missing = []
    for file, line, module, name in imports:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] != "kvcache":
                continue  # needs an optional extra (Ray Serve for the replicas): its tests skip without it
            missing.append(f"{file}:{line}: from {module} import {name} ({e})")
            continue
        if name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{file}:{line}: from {module} import {name}")
    assert not missing, "names the tests import that kvcache no longer has:\n" + "\n".join(missing)
