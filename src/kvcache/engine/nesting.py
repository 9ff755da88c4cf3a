"""How deeply a structure nests, measured without recursion, so that a bound can be checked before
any recursive code (a schema validator, a grammar converter, a template) sees it.

- ``value_depth``: JSON values (dicts and lists): ``{}`` and ``[]`` are 1 level, ``{"a": []}`` 2.
- ``text_depth``: the same count over text in one of four syntaxes (JSON, GBNF, Lark, regex): the
  brackets that nest in that syntax, skipping string literals, character classes, regex literals
  and comments, so a bracket inside a literal never counts.

``MAX_DEPTH`` is the bound kvcache applies to every schema, grammar and request field.
"""

from __future__ import annotations

import re
from typing import Any

MAX_DEPTH = 64  # levels; Python's recursion (jsonschema's checks, the GBNF converter) breaks near 100-400
# a JSON schema's levels are its subschemas: the maps and lists that hold subschemas ("properties",
# "anyOf") are not levels of their own, so one schema level may take two JSON levels
MAX_SCHEMA_JSON_DEPTH = 2 * MAX_DEPTH + 2
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
DATA_KEYWORDS = ("const", "enum", "default", "examples")

_STR = r'"(?:[^"\\]|\\.)*"'
_CLASS = r"\[(?:\\.|[^\]\\])*\]"
# per syntax: one regex whose matches are either a skipped literal or a single bracket
_TOKENS = {
    "json": re.compile(rf"{_STR}|[\[\]{{}}]", re.S),
    "gbnf": re.compile(rf"{_STR}|{_CLASS}|#[^\n]*|[()]", re.S),
    "lark": re.compile(rf"{_STR}|//[^\n]*|/(?:\\.|{_CLASS}|[^/\\\n\[])+/|[()\[\]{{}}]", re.S),
    "regex": re.compile(rf"\\.|{_CLASS}|[()]", re.S),
}
_OPEN, _CLOSE = frozenset("([{"), frozenset(")]}")


def value_depth(value: Any, limit: int | None = None) -> int:
    """The nesting depth of a JSON value (0 for a scalar); with ``limit``, it stops counting at
    ``limit + 1`` (enough to know the bound is passed)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            items: Any = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        deepest = max(deepest, depth)
        if limit is not None and deepest > limit:
            return deepest
        stack.extend((c, depth + 1) for c in items if isinstance(c, (dict, list)))
    return deepest


def schema_depth(schema: Any, limit: int | None = None) -> int:
    """The nesting of a JSON schema in schema levels: a subschema is one level deeper than the schema
    holding it, whether it sits under ``items`` or inside ``properties`` or ``anyOf`` (those maps and
    lists are not levels); the data of ``const``, ``enum``, ``default`` and ``examples`` counts its
    own JSON levels from where it sits. With ``limit``, counting stops once it is passed."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        s, depth = stack.pop()
        if not isinstance(s, dict):
            if isinstance(s, list):  # a schema where a list is (items as a list, in older drafts)
                stack.extend((c, depth) for c in s if isinstance(c, (dict, list)))
            continue
        deepest = max(deepest, depth)
        if limit is not None and deepest > limit:
            return deepest
        for key, v in s.items():
            if key in DATA_KEYWORDS:
                deepest = max(deepest, depth + value_depth(v, limit))
            elif key in SCHEMA_MAPS and isinstance(v, dict):
                stack.extend((c, depth + 1) for c in v.values() if isinstance(c, (dict, list)))
            elif key in SCHEMA_LISTS and isinstance(v, list):
                stack.extend((c, depth + 1) for c in v if isinstance(c, (dict, list)))
            elif isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return deepest


def text_depth(text: str, syntax: str) -> int:
    """The deepest bracket nesting of ``text`` in ``syntax`` ("json", "gbnf", "lark" or "regex"),
    literals skipped; an unbalanced closing bracket counts as nothing."""
    depth = deepest = 0
    for m in _TOKENS[syntax].finditer(text):
        tok = m.group()
        if len(tok) != 1:
            continue
        if tok in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif tok in _CLOSE:
            depth = max(0, depth - 1)
    return deepest


def grammar_syntax(text: str) -> str:
    """"gbnf" for llama.cpp's grammars (rules written ``name ::= ...``), else "lark"."""
    return "gbnf" if "::=" in text else "lark"
