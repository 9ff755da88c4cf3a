"""The texts of ``kvcache bench spec``'s workloads (bench/spec.py), kept as files in bench/texts/:
a Python file to edit (orders.py.txt), the file as a prediction, another file as a prediction that
misses (wordcount.md: sent by mistake, Python all the same), a document to quote (museum.txt), a
story."""

from __future__ import annotations

from pathlib import Path

_TEXTS = Path(__file__).with_name("texts")


def _read(name: str) -> str:
    return (_TEXTS / name).read_text(encoding="utf-8")


CODE = _read("orders.py.txt")
EDIT = ("Here is a Python file:\n\n```python\n" + CODE + "```\n\nRename the function `parse_line` to `parse_row` "
        "everywhere it appears. Reply with the complete updated file and nothing else.")
EDIT_PREDICTION = "```python\n" + CODE + "```"  # the file as the answer writes it
MISS = _read("wordcount.md")
DOCUMENT = _read("museum.txt")
QUESTION = DOCUMENT + "\nWhat are the museum's opening hours? Quote the text."
STORY = "Write a short story about a dragon."
