"""How deeply a request's structures may nest, checked on the parsed body before anything recursive
(jsonschema's checks, the GBNF converter, pydantic, chat templates) sees them.

Every field's value may nest ``MAX_DEPTH`` levels (JSON objects and arrays) counted from the field
itself: a top-level field (``metadata``), or one of ``FIELDS`` within it (a tool's ``parameters``,
a message's ``content``), so the bound means the same wherever the structure sits. Fields that
carry a structure as text are measured in their syntax (``TEXT_FIELDS``: a schema given as JSON
text, a tool call's arguments, a GBNF or Lark grammar, a regex). Too deep: 400 naming the field,
``response_format.json_schema.schema is nested deeper than 64 levels``.

``recursion_reply`` is the app's handler for a RecursionError raised anyway while a request is
handled: 400 naming the deepest field of the body (``check_depth`` leaves it on the request), one
log line, no traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from kvcache.engine.nesting import MAX_DEPTH, MAX_SCHEMA_JSON_DEPTH, grammar_syntax, text_depth
from kvcache.server.protocol import ApiError, error_body

log = logging.getLogger("kvcache.server")
STATE_KEY = "kvcache_deepest"  # http.state's name for the body's deepest field
ANY = "*"  # a list index in a pattern
# fields measured from their own start, not from the top-level field that holds them
FIELDS = (("response_format", "json_schema", "schema"), ("tools", ANY, "function", "parameters"),
          ("messages", ANY, "content"), ("messages", ANY, "tool_calls"), ("prediction", "content"),
          ("response_format", "schema"))
# fields that hold a JSON schema: bounded in schema levels (engine/nesting.py, schema_depth) where
# the schema is read, and here only by MAX_SCHEMA_JSON_DEPTH JSON levels (a schema level may take two)
SCHEMAS = (("response_format", "json_schema", "schema"), ("tools", ANY, "function", "parameters"),
           ("response_format", "schema"), ("guided_json",))
# text fields that carry a structure, and its syntax ("grammar": GBNF or Lark, told apart by the text)
TEXT_FIELDS = {("guided_json",): "json", ("response_format", "json_schema", "schema"): "json",
               ("messages", ANY, "tool_calls", ANY, "function", "arguments"): "json",
               ("guided_grammar",): "grammar", ("guided_regex",): "regex"}

# (length, first key) of the patterns: most of a body's nodes are ruled out by these alone
FIELD_SHAPES = frozenset((len(f), f[0]) for f in FIELDS)
TEXT_SHAPES = frozenset((len(f), f[0]) for f in TEXT_FIELDS)


def _matches(parts: tuple, pattern: tuple) -> bool:
    return len(parts) == len(pattern) and all(p == ANY and isinstance(k, int) or p == k
                                              for k, p in zip(parts, pattern))


def _name(parts: tuple) -> str:
    return ".".join(str(p) for p in parts) or "the request body"


def check_depth(body: Any) -> tuple[str, int] | None:
    """400 naming the first field nested deeper than ``MAX_DEPTH``; else the deepest field and its
    depth (None when the body holds no structure). Walks the body once, without recursion."""
    deepest: tuple[str, int] | None = None
    # (value, path, length of the path of the field it is measured from)
    stack: list[tuple[Any, tuple, int]] = [(body, (), 0)] if isinstance(body, (dict, list)) else []
    while stack:
        value, parts, root = stack.pop()
        if isinstance(value, str):
            _check_text(value, parts)
            continue
        children: Any = value.items() if isinstance(value, dict) else enumerate(value)
        depth = len(parts) - root + 1
        if depth > MAX_DEPTH and (depth > MAX_SCHEMA_JSON_DEPTH
                                  or not any(_matches(parts[:root], f) for f in SCHEMAS)):
            field = _name(parts[:root])
            raise ApiError(400, f"{field} is nested deeper than {MAX_DEPTH} levels", param=field if root else None)
        if deepest is None or depth > deepest[1]:
            deepest = (_name(parts[:root]), depth)
        top = not parts and isinstance(value, dict)  # the body's fields: each measured from itself
        first = parts[0] if parts else None
        fields = (len(parts) + 1, first) in FIELD_SHAPES
        texts = top or (len(parts) + 1, first) in TEXT_SHAPES
        for k, v in children:
            if isinstance(v, (dict, list)):
                sub = parts + (k,)
                own = len(sub) if top or fields and any(_matches(sub, f) for f in FIELDS) else root
                stack.append((v, sub, own))
            elif texts and isinstance(v, str):
                stack.append((v, parts + (k,), root))
    return deepest


def _check_text(text: str, parts: tuple) -> None:
    for pattern, syntax in TEXT_FIELDS.items():
        if _matches(parts, pattern):
            limit = MAX_SCHEMA_JSON_DEPTH if any(_matches(parts, f) for f in SCHEMAS) else MAX_DEPTH
            if text_depth(text, grammar_syntax(text) if syntax == "grammar" else syntax) > limit:
                raise ApiError(400, f"{_name(parts)} is nested deeper than {MAX_DEPTH} levels", param=_name(parts))
            return


def remember(http: HttpRequest, deepest: tuple[str, int] | None) -> None:
    """Leave the body's deepest field on the request, for ``recursion_reply``."""
    setattr(http.state, STATE_KEY, deepest[0] if deepest else None)


async def recursion_reply(http: HttpRequest, e: Exception) -> JSONResponse:
    """A RecursionError raised while a request was handled: 400 naming the body's deepest field."""
    field = getattr(http.state, STATE_KEY, None)
    log.warning("kvcache: %s %s: %s nested too deeply to handle (RecursionError); answered 400",
                http.method, http.url.path, field or "the request")
    message = f"{field or 'the request'} is nested too deeply to be handled"
    return JSONResponse(error_body(message, param=field), status_code=400)
