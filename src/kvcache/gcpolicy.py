"""Python's cyclic garbage collector around a command's start-up.

Importing torch, transformers and fastapi and loading a model make a few million objects that live
as long as the process, and the collector walks them again and again while they are made (a fifth
of the imports' time, measured: 3.1-3.6 s of imports with it, 2.7-2.9 s without), then at every full
collection while the process serves. A kvcache command defers collection from its first line
(``defer``) until its model has loaded (``settle``, which ``LLM`` calls): what exists then moves to
the permanent generation (``gc.freeze``) and collection resumes, so later collections walk only
what requests make. Library users who never call ``defer`` see no change.

The base layer: imports nothing of kvcache.
"""

from __future__ import annotations

import gc

_deferred = False


def defer() -> None:
    """No collections until ``settle`` (a command's first line)."""
    global _deferred
    if gc.isenabled():
        gc.disable()
        _deferred = True


def settle() -> None:
    """After a deferred start-up: freeze what was made and collect again; otherwise nothing."""
    global _deferred
    if _deferred:
        _deferred = False
        gc.freeze()
        gc.enable()
