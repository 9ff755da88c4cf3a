"""The bounds a chat template renders under: a deadline, a cap on the text it may build, and the
checks that keep each step of a render under them.

A template comes with the model file and runs on a worker thread, which cannot be killed: a
runaway render has to stop itself. The rendering environment (models/templates.py) calls into
this module at every point where time or memory can grow without limit:

- ``tick()`` at every loop iteration, call, intercepted operator and piece of output: past the
  deadline it raises ``Exceeded``, so a render stops within about one step of its deadline;
- ``add_work(n)`` for every piece of text written, at any level (macros, blocks, the output):
  the total is capped at ``WORK_FACTOR`` times the output cap, which bounds what nested buffers
  may hold;
- the operators, filters and ``str`` methods that build big values are estimated before they
  run (models/template_checks.py): a value over the cap is refused before it is allocated.

Sizes are counted in characters of text: a container counts as the text of its repr (``measure``),
so a list of a million references to one big string counts as what printing it would write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

DEFAULT_TIMEOUT = 1.0  # seconds a render may take (--template-timeout)
MAX_SOURCE = 128 << 10  # characters of template source compiled at all (the largest real ones: ~17 K;
# compiling 128 KiB of tags takes up to 2 s and 240 MB, 1 MiB up to 46 s and 1.7 GB)
MAX_TEXT, MIN_TEXT = 4 << 20, 64 << 10  # the output cap, whatever the context (characters)
CHARS_PER_TOKEN = 32  # no vocabulary's tokens average more characters than this over a prompt
WORK_FACTOR = 16  # text written at every level, as a multiple of the output cap
MAX_ITEMS = 1 << 20  # items of a list a filter builds (list, batch, slice)
MAX_LINES = 1 << 17  # lines wordwrap may cut (its time grows with them)
MAX_INT_BITS = 1 << 16  # integers built by * and ** (str() of a longer one is refused anyway)
MAX_DEPTH = 256  # nesting of a value measured
RUN_FREELY, PAUSE = 0.05, 0.001  # a long render gives the GIL away (``tick``)


class Exceeded(Exception):
    """A bound of the render was reached; the message says which, in one line."""


def text_limit(context: int | None) -> int:
    """The output cap for a model of ``context`` tokens: ``CHARS_PER_TOKEN`` characters per
    token, between ``MIN_TEXT`` and ``MAX_TEXT`` (``MAX_TEXT`` when the context is unknown). A
    prompt longer than that could never fit the context, and tokenizing it only to refuse it
    costs seconds (about 5 s per MiB)."""
    if not isinstance(context, int) or context <= 0:
        return MAX_TEXT
    return max(MIN_TEXT, min(MAX_TEXT, context * CHARS_PER_TOKEN))


def size_label(chars: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if chars >= scale and chars % scale == 0:
            return f"{chars // scale} {unit}"
    return f"{chars:,} characters"


# -- the render in progress (one per thread) -------------------------------------------------------
class _Render:
    __slots__ = ("deadline", "timeout", "work", "max_work", "pause_at", "long")

    def __init__(self, timeout: float, max_chars: int) -> None:
        now = time.monotonic()
        self.timeout = timeout
        self.deadline = now + timeout
        self.pause_at = now + RUN_FREELY
        self.long = False  # holds _LONG
        self.work = 0
        self.max_work = WORK_FACTOR * max_chars


_LOCAL = threading.local()
_LONG = threading.Lock()  # held by the one long render that may run at a time


def begin(timeout: float, max_chars: int) -> None:
    """Start the bounds of a render on this thread (``end`` stops them)."""
    _LOCAL.render = _Render(timeout, max_chars)


def end() -> None:
    r = getattr(_LOCAL, "render", None)
    if r is not None and r.long:
        _LONG.release()
    _LOCAL.render = None


def tick() -> None:
    """Refuse to go on past the deadline of the render on this thread (none at compile time).

    A render that has run for ``RUN_FREELY`` seconds (fifty times an honest one) goes on only in
    turns: one such render at a time, and that one sleeping ``PAUSE`` out of every two. Pure
    Python holds the GIL; without the turns, a few runaway renders would make every other thread
    (the engine's steps, other requests' renders) wait up to the interpreter's switch interval
    (5 ms) for each of its Python steps until their deadlines. A render waiting for its turn
    still stops at its deadline."""
    r = getattr(_LOCAL, "render", None)
    if r is None:
        return
    now = time.monotonic()
    if now > r.deadline:
        raise Exceeded(f"rendering took more than {float(r.timeout)!r} s (--template-timeout)")
    if now > r.pause_at:
        if r.long:
            r.long = False
            _LONG.release()
        time.sleep(PAUSE)
        r.long = _LONG.acquire(timeout=max(0.0, r.deadline - time.monotonic()))
        if not r.long:
            raise Exceeded(f"rendering took more than {float(r.timeout)!r} s (--template-timeout)")
        r.pause_at = time.monotonic() + PAUSE


def add_work(chars: int) -> None:
    r = getattr(_LOCAL, "render", None)
    if r is None:
        return
    r.work += chars
    if r.work > r.max_work:
        raise Exceeded(f"the template wrote more than {size_label(r.max_work)} of text into its "
                       "output, macros and blocks")
    tick()


# -- sizes ------------------------------------------------------------------------------------------
def measure(value: Any) -> tuple[int, int, int]:
    """(characters of ``value``'s text, items in its containers, nesting depth), each shared
    part counted as often as it is referenced (as printing it would), found in one pass over the
    distinct objects."""
    from jinja2.utils import Namespace

    memo: dict[int, tuple[int, int, int]] = {}

    def walk(x: Any, depth: int) -> tuple[int, int, int]:
        if isinstance(x, (str, bytes)):
            return len(x), 0, 0
        if x is None or isinstance(x, (bool, float)):
            return 24, 0, 0
        if isinstance(x, int):
            return x.bit_length() // 3 + 2, 0, 0
        key = id(x)
        if key in memo:
            return memo[key]
        if isinstance(x, Mapping):
            parts: Any = [*x.keys(), *x.values()]
        elif isinstance(x, (list, tuple, set, frozenset)):
            parts = x
        elif isinstance(x, Namespace):
            parts = list(x._Namespace__attrs.items())
        else:
            return 64, 0, 0
        if depth >= MAX_DEPTH:
            raise Exceeded(f"a value is nested more than {MAX_DEPTH} deep")
        memo[key] = (64, 0, 0)  # a value that holds itself counts once
        chars, items, deepest = 2, 0, 0
        for p in parts:
            c, i, d = walk(p, depth + 1)
            chars, items, deepest = chars + c + 2, items + i + 1, max(deepest, d)
        memo[key] = out = (chars, items, deepest + 1)
        return out

    return walk(value, 0)


def chars_of(value: Any) -> int:
    return len(value) if isinstance(value, str) else measure(value)[0]


def refuse_over(chars: int, limit: int, what: str) -> None:
    if chars > limit:
        raise Exceeded(f"{what} would make more than {size_label(limit)} of text")
