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


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", text))


def test_the_documented_refused_parameters_are_the_servers():
    """README and RELIABILITY.md name exactly the parameters the server refuses as not implemented
    (server/intake.py's UNSUPPORTED, and best_of), no fewer and none that works."""
    from kvcache.server.intake import UNSUPPORTED

    refused = set(UNSUPPORTED) | {"best_of"}
    readme = (ROOT / "README.md").read_text()
    lists = re.findall(r"does not implement \(([^)]*)\)", readme, flags=re.S)
    assert len(lists) == 2, "README names the refused parameters in its serving and sampling paragraphs"
    for found in lists:
        assert _backticked(found) - {"n"} == refused, found
    rows = [line for line in (ROOT / "RELIABILITY.md").read_text().splitlines() if "unsupported_parameter" in line]
    assert len(rows) == 1
    assert _backticked(rows[0].split("|")[1]) - {"n"} == refused, rows[0]
