"""Python's cyclic garbage collector around a command's start-up.

Importing torch, transformers and fastapi and loading a model make a few million objects that live
as long as the process, and the collector walks them again and again while they are made (a fifth
of the imports' time, measured: 2.4-3.1 s of imports as Python collects, 2.0-2.2 s without, 2.3-2.5
s with the raised threshold below), then at every full collection while the process serves. A
kvcache command collects rarely from its first line (``defer``: a young generation of 100,000
objects instead of 700, so memory stays bounded even in a command that never loads a model) until
its model has loaded (``settle``, which ``LLM`` calls): what exists then moves to the permanent
generation (``gc.freeze``) and the thresholds come back, so later collections walk only what
requests make. Library users who never call ``defer`` see no change.

The base layer: imports nothing of kvcache.
"""

from __future__ import annotations

import gc

START_UP = (100_000, 50, 50)  # the thresholds while a command starts
_saved: tuple[int, int, int] | None = None  # the thresholds defer replaced


def defer() -> None:
    """Collect rarely until ``settle`` (a command's first line)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(*START_UP)


def settle() -> None:
    """After a deferred start-up: freeze what was made and collect as before; otherwise nothing."""
    global _saved
    if _saved is not None:
        gc.freeze()
        gc.set_threshold(*_saved)
        _saved = None
