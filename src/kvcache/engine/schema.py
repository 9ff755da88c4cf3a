"""JSON schemas as constrained decoding should read them: objects closed to their declared
properties, and whitespace between JSON tokens bounded.

JSON Schema's default lets an object hold any key its schema does not name. For validation that is
harmless; for generation it lets a model write invented keys until ``max_tokens`` (instructor's
JSON_SCHEMA mode and OpenAI's client send Pydantic's schemas, which never say
``additionalProperties``). xgrammar (vLLM, SGLang) and llama.cpp's converter generate only the
declared properties unless the schema asks for more, and so does kvcache:

- ``closed_schema``: every object schema that lists ``properties`` (and ``required`` names missing
  from them, which it adds as any value) gets ``additionalProperties: false``, unless it says
  ``additionalProperties``, ``patternProperties``, ``unevaluatedProperties`` or ``propertyNames``
  itself. Subschemas are followed through ``properties``, ``items``, ``prefixItems``,
  ``additionalProperties``, ``anyOf``, ``oneOf``, ``$defs`` and ``definitions``; never into ``not``
  (closing there would widen what it forbids). The parts of an ``allOf`` of more than one part
  (and the ``$defs`` they ``$ref``) stay open: closing one part would forbid the others' keys; so
  do ``properties`` beside a ``$ref`` and its target.
  ``"x-kvcache": {"additionalProperties": true}`` at the schema's root keeps JSON Schema's open
  default for the whole schema.
- ``bounded_whitespace``: a schema's own ``x-guidance`` (llguidance's options) asking for
  ``whitespace_flexible`` without a ``whitespace_pattern`` gets llama.cpp's bounded whitespace
  (``WHITESPACE``: nothing, a space, or one or two newlines and up to 20 spaces or tabs) instead of
  llguidance's unbounded ``[ \\t\\n\\r]+``. kvcache's own default is no whitespace beyond ``", "``
  and ``": "`` (grammar.JSON_OPTIONS).
"""

from __future__ import annotations

from typing import Any

from kvcache.engine.nesting import MAX_DEPTH, MAX_SCHEMA_JSON_DEPTH, schema_depth, value_depth
from kvcache.errors import InvalidParams

WHITESPACE = r"(| |\n{1,2}[ \t]{0,20})"  # llama.cpp's SPACE_RULE
OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "$defs", "definitions")
SCHEMA_ONE = ("items", "additionalProperties", "additionalItems")
OWN_KEY = "x-kvcache"


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` whose objects admit their declared properties only (see the module
    docstring); the input is left as it is. A schema nested deeper than ``MAX_DEPTH`` levels, or a
    bad ``x-kvcache``, raises InvalidParams."""
    if not isinstance(schema, dict):
        raise InvalidParams(f"a JSON schema must be an object, got {type(schema).__name__}")
    if (value_depth(schema, MAX_SCHEMA_JSON_DEPTH) > MAX_SCHEMA_JSON_DEPTH
            or schema_depth(schema, MAX_DEPTH) > MAX_DEPTH):
        raise InvalidParams(f"the JSON schema is nested deeper than {MAX_DEPTH} levels (of subschemas)")
    out = dict(schema)
    own = out.pop(OWN_KEY, None)
    if _open_default(own):
        return out
    return _close(out, _allof_refs(out))


def _open_default(own: Any) -> bool:
    if own is None:
        return False
    if not isinstance(own, dict) or set(own) - {"additionalProperties"} \
            or not isinstance(own.get("additionalProperties", False), bool):
        raise InvalidParams(f'{OWN_KEY} must be {{"additionalProperties": true or false}}, got {own!r}'[:200])
    return bool(own.get("additionalProperties", False))


def _allof_refs(schema: dict[str, Any]) -> set[str]:
    """The local ``$ref`` targets that are parts of an ``allOf`` with other parts (left open)."""
    found: set[str] = set()
    stack: list[Any] = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        parts = s.get("allOf") if isinstance(s.get("allOf"), list) else []
        if _parts(s) > 1:
            found.update(p["$ref"] for p in [s, *parts] if isinstance(p, dict) and isinstance(p.get("$ref"), str))
        stack.extend(v for k, v in s.items() if k not in ("const", "enum", "default", "examples"))
    return found


def _parts(s: dict[str, Any]) -> int:
    """How many schemas an object's keys come from: its ``allOf`` parts, its own ``properties`` and a
    sibling ``$ref`` (which 2019-09 and later apply beside them)."""
    parts = s.get("allOf")
    return (len(parts) if isinstance(parts, list) else 0) + ("properties" in s) + ("$ref" in s)


def _close(s: Any, keep_open: set[str], pointer: str = "#", closable: bool = True) -> Any:
    """The closed copy of subschema ``s`` at JSON pointer ``pointer`` (depth is bounded: recursion is safe)."""
    if not isinstance(s, dict):
        return s
    out = dict(s)
    parts = out.get("allOf")
    in_allof = _parts(out) > 1
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, keep_open, f"{pointer}/{key}/{name}")
                        for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub, keep_open, f"{pointer}/{key}/{i}") for i, sub in enumerate(out[key])]
    for key in SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], keep_open, f"{pointer}/{key}")
        elif key == "items" and isinstance(out.get(key), list):  # draft 4-7 tuples
            out[key] = [_close(sub, keep_open, f"{pointer}/items/{i}") for i, sub in enumerate(out[key])]
    if isinstance(parts, list):
        out["allOf"] = [_close(sub, keep_open, f"{pointer}/allOf/{i}", not in_allof) for i, sub in enumerate(parts)]
    if closable and not in_allof and pointer not in keep_open and isinstance(out.get("properties"), dict) \
            and not any(k in out for k in OPENERS):
        required = out.get("required")
        missing = [r for r in required if isinstance(r, str) and r not in out["properties"]] \
            if isinstance(required, list) else []
        if missing:
            out["properties"] = {**out["properties"], **{name: {} for name in missing}}
        out["additionalProperties"] = False
    return out


def bounded_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``x-guidance`` whitespace bounded (see the module docstring)."""
    options = schema.get("x-guidance")
    if not isinstance(options, dict) or not options.get("whitespace_flexible") or "whitespace_pattern" in options:
        return schema
    return {**schema, "x-guidance": {**options, "whitespace_pattern": WHITESPACE}}
