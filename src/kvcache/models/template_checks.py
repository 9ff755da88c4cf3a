"""Estimates of what an operator, filter or ``str`` method of a chat template would build, made
before it runs: one whose result would pass the render's text cap is refused (``Exceeded``) before
anything is allocated. Each estimate is an upper bound of the text (or the items, or the integer's
bits) the call would make; the bounds themselves are in models/template_limits.py.

- ``check_binop``: ``+ * ** %`` (the sandbox's intercepted operators);
- ``check_method``: the ``str`` methods that grow text (``center ljust rjust zfill expandtabs
  replace join format format_map translate``);
- ``FILTER_CHECKS``: Jinja's filters that grow text or make many items (``center indent replace
  join format wordwrap tojson pprint string xmlattr urlize batch slice list sum``);
- ``check_lipsum``: the ``lipsum()`` global.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from kvcache.models.template_limits import (MAX_INT_BITS, MAX_ITEMS, MAX_LINES, Exceeded, chars_of, measure,
                                            refuse_over)

# -- operators ---------------------------------------------------------------------------------------
SEQUENCES = (str, list, tuple, bytes)


def check_binop(op: str, left: Any, right: Any, limit: int) -> None:
    """Refuse ``left op right`` when its result would pass the cap (``+ * ** %``)."""
    if op == "+" and isinstance(left, SEQUENCES) and isinstance(right, SEQUENCES):
        refuse_over(chars_of(left) + chars_of(right), limit, "the operator +")
    elif op == "*":
        seq, n = (left, right) if isinstance(left, SEQUENCES) else (right, left)
        if isinstance(seq, SEQUENCES) and isinstance(n, int) and n > 1:
            refuse_over(chars_of(seq) * n, limit, "the operator *")
        elif isinstance(left, int) and isinstance(right, int):
            _refuse_int(left.bit_length() + right.bit_length(), "*")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _refuse_int(left.bit_length() * right, "**")
    elif op == "%" and isinstance(left, str):
        refuse_over(percent_size(left, right), limit, "the operator %")


def _refuse_int(bits: int, op: str) -> None:
    if bits > MAX_INT_BITS:
        raise Exceeded(f"the operator {op} would make an integer of more than {MAX_INT_BITS} bits")


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def percent_size(fmt: str, args: Any) -> int:
    """An upper bound of ``len(fmt % args)``: each conversion writes at most the widest argument
    (four times it for %r and %a), or its width or precision."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    widest = max((chars_of(v) for v in values), default=0)
    star = max((abs(v) for v in values if isinstance(v, int)), default=0)
    total = len(fmt)
    for m in _PERCENT.finditer(fmt):
        width, precision, kind = m.groups()
        sizes = [widest * (4 if kind in "ra" else 1)]
        sizes += [star if g == "*" else int(g) + 32 for g in (width, precision) if g]
        total += max(sizes)
    return total


def format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """An upper bound of ``len(fmt.format(*args, **kwargs))`` (widths and precisions included)."""
    values = [*args, *kwargs.values()]
    widest = max((chars_of(v) for v in values), default=0)
    star = max((abs(v) for v in values if isinstance(v, int)), default=0)
    total = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # str.format refuses it the same way
    for literal, field, spec, conversion in fields:
        total += len(literal)
        if field is not None:
            sizes = [widest * (4 if conversion in ("r", "a") else 1)]
            sizes += [int(n) + 32 for n in re.findall(r"\d+", spec or "")] + ([star] if "{" in (spec or "") else [])
            total += max(sizes)
    return total


# -- str methods a template may call -----------------------------------------------------------------
def check_method(func: Any, args: tuple, kwargs: dict, limit: int) -> tuple:
    """Refuse a call of a ``str`` method whose result would pass the cap; the arguments to call
    it with (``join`` takes its items as a list, counted first)."""
    target = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if not isinstance(owner, str):
        return args
    what = f"str.{name}()"
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width")
        if isinstance(width, int):
            refuse_over(width, limit, what)
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            refuse_over(len(owner) + owner.count("\t") * size, limit, what)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        refuse_over(replace_size(owner, args[0], args[1], args[2] if len(args) > 2 else -1), limit, what)
    elif name == "join" and args:
        items = list(args[0])
        refuse_over(sum(chars_of(x) for x in items) + len(owner) * len(items), limit, what)
        args = (items, *args[1:])
    elif name == "format":
        refuse_over(format_size(owner, args, kwargs), limit, what)
    elif name == "format_map" and args and isinstance(args[0], Mapping):
        refuse_over(format_size(owner, (), args[0]), limit, what)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((chars_of(v) for v in args[0].values() if isinstance(v, str)), default=1)
        refuse_over(len(owner) * max(1, longest), limit, what)
    return args


def replace_size(s: str, old: str, new: str, count: Any = -1) -> int:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


# -- filters: each check reads the filter's arguments by name (``a``) and may replace one ------------
def _center(limit: int, a: dict) -> None:
    if isinstance(a["width"], int):
        refuse_over(a["width"], limit, "the filter center")


def _indent(limit: int, a: dict) -> None:
    text, width = str(a["s"]), a["width"]
    step = width if isinstance(width, int) else len(str(width))
    refuse_over(len(text) + (text.count("\n") + 1) * max(0, step), limit, "the filter indent")


def _replace(limit: int, a: dict) -> None:
    count = -1 if a["count"] is None else a["count"]
    refuse_over(replace_size(str(a["s"]), str(a["old"]), str(a["new"]), count), limit, "the filter replace")


def _join(limit: int, a: dict) -> None:
    a["value"] = items = list(a["value"])
    refuse_over(chars_of(items) + len(str(a["d"])) * len(items), limit, "the filter join")


def _format(limit: int, a: dict) -> None:
    refuse_over(percent_size(str(a["value"]), a["kwargs"] or a["args"]), limit, "the filter format")


def _wordwrap(limit: int, a: dict) -> None:
    text, width, wrap = str(a["s"]), a["width"], a["wrapstring"]
    lines = text.count("\n") + len(text) // max(1, width if isinstance(width, int) else 1) + 1
    if lines > MAX_LINES:
        raise Exceeded(f"the filter wordwrap would cut more than {MAX_LINES} lines")
    refuse_over(len(text) + lines * len(wrap if isinstance(wrap, str) else "\n"), limit, "the filter wordwrap")


def _whole(name: str, key: str, indent: str | None = None) -> Callable[[int, dict], None]:
    """A filter that writes its whole value as text, with indentation per item (escapes may
    make the text a few times longer: the result is checked too)."""

    def check(limit: int, a: dict) -> None:
        chars, items, depth = measure(a[key])
        step = a.get(indent) if indent else 1
        step = len(step) if isinstance(step, str) else step if isinstance(step, int) else 1
        refuse_over(chars + items * depth * max(1, step), limit, f"the filter {name}")

    return check


def _many(name: str, key: str, only_with_fill: bool) -> Callable[[int, dict], None]:
    """A filter that makes as many lists (or fill items) as its argument ``key`` says."""

    def check(limit: int, a: dict) -> None:
        n = a[key]
        if isinstance(n, int) and n > MAX_ITEMS and (not only_with_fill or a["fill_with"] is not None):
            raise Exceeded(f"the filter {name} would make more than {MAX_ITEMS} items")

    return check


def _list(limit: int, a: dict) -> None:
    if hasattr(a["value"], "__len__") and len(a["value"]) > MAX_ITEMS:
        raise Exceeded(f"the filter list would make more than {MAX_ITEMS} items")


def _sum(limit: int, a: dict) -> None:
    a["iterable"] = items = list(a["iterable"])
    if any(isinstance(x, SEQUENCES) for x in items):
        refuse_over(chars_of(items) + chars_of(a["start"]), limit, "the filter sum")


def _urlize(limit: int, a: dict) -> None:
    text = str(a["value"])
    extra = sum(len(str(a[k])) for k in ("target", "rel") if a[k])  # written into every link
    refuse_over(3 * len(text) + (len(text) // 2 + 1) * (64 + extra), limit, "the filter urlize")


FILTER_CHECKS: dict[str, Callable[[int, dict], None]] = {
    "center": _center, "indent": _indent, "replace": _replace, "join": _join, "format": _format,
    "wordwrap": _wordwrap, "tojson": _whole("tojson", "x", "indent"), "pprint": _whole("pprint", "value"),
    "string": _whole("string", "s"), "xmlattr": _whole("xmlattr", "d"), "urlize": _urlize,
    "batch": _many("batch", "linecount", True), "slice": _many("slice", "slices", False), "list": _list,
    "sum": _sum,
}


def check_lipsum(limit: int, n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> None:  # noqa: A002
    if isinstance(n, int) and isinstance(max, int):
        refuse_over(n * max * 16, limit, "lipsum()")
