"""The docs name what exists: every source file docs/architecture.md and README.md cite is in the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cited_files(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_/]*\.(?:py|c|h)\b", text))


def missing(text: str, tree: list[Path]) -> list[str]:
    names = {p.as_posix() for p in tree}
    return sorted(n for n in cited_files(text) if not any(f == n or f.endswith("/" + n) for f in names))


def _tree() -> list[Path]:
    return [p.relative_to(ROOT) for top in ("src", "tests", ".ci", "tools") if (ROOT / top).exists()
            for p in (ROOT / top).rglob("*") if p.is_file()]


def test_architecture_and_readme_cite_only_files_that_exist():
    tree = _tree()
    for doc in ("docs/architecture.md", "README.md"):
        gone = missing((ROOT / doc).read_text(), tree)
        assert not gone, f"{doc} cites files that do not exist: {gone}"


def test_a_missing_file_is_reported():
    assert missing("see cache/pages.py and cache/nowhere.py", [Path("src/kvcache/cache/pages.py")]) == ["cache/nowhere.py"]
