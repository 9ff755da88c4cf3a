"""conftest.py's SLOW (what make test leaves to make test-all) names tests that exist: an entry left
behind by a rename would silently move a slow test back into the quick suite, or name nothing."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import SLOW

TESTS = Path(__file__).parent


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_every_slow_entry_names_a_test_file_and_a_test_in_it():
    files = {p.name: p for p in TESTS.rglob("test_*.py")}
    missing = []
    for entry in sorted(SLOW):
        file, _, test = entry.partition("::")
        if file not in files:
            missing.append(entry)
        elif test and test.split("[")[0] not in _defined(files[file]):
            missing.append(entry)
    assert not missing, missing
