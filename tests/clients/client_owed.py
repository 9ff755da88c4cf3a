"""What `kvcache serve` owes any client, checked on one recorded exchange (client_wire.Exchange):

- every request is accepted (200) or refused with a 400 whose ``error.param`` names the parameter;
- a forced tool call (``tool_choice`` "required" or a named function) comes back as parsed
  ``tool_calls`` and ends with ``finish_reason`` "tool_calls", with no call repeated, no tool-call
  markup left in ``content``, and at most one call when ``parallel_tool_calls`` is false;
- every call names an offered tool (the named one when forced by name) and its arguments are a JSON
  object valid against that tool's parameters;
- a ``json_schema`` answer that ended by itself ("stop") is valid against the schema; a
  ``json_object`` answer that ended by itself is a JSON object.

Model quality (what a 135M model chooses to write) is not checked here; the tests say what they
assert beyond this.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

TOOL_MARKUP = "<tool_call"


def owed(ex) -> list[str]:
    """What ``ex`` lacks of what the server owes (empty: nothing)."""
    if ex.status == 400:
        err = (ex.reply() or {}).get("error") or {}
        param = err.get("param") or ""
        named = param and (param.split(".")[0] in (ex.request or {}) or param in (err.get("message") or ""))
        return [] if named else [f"400 whose param does not name a field of the request: {err}"]
    if ex.status != 200:
        return [f"status {ex.status}: {ex.body()[:300]!r}"]
    if not ex.path.endswith("/chat/completions"):
        return []
    reply, req = ex.reply(), ex.request or {}
    if not reply or "choices" not in reply:
        return [f"no completion in the reply: {ex.body()[:300]!r}"]
    out = []
    for choice in reply["choices"]:
        out += [f"choice {choice.get('index')}: {p}" for p in _choice_owed(choice, req)]
    return out


def _tools(req: dict) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"] for t in req.get("tools") or [] if t.get("type") == "function"}


def _forced(req: dict) -> str | None:
    """'required', the forced function's name, or None when no call is forced."""
    choice = req.get("tool_choice")
    if not req.get("tools") or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return "required"
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    return None


def _choice_owed(choice: dict, req: dict) -> list[str]:
    out: list[str] = []
    msg, finish = choice.get("message") or {}, choice.get("finish_reason")
    calls = msg.get("tool_calls") or []
    content = msg.get("content") or ""
    tools, forced = _tools(req), _forced(req)
    if finish not in ("stop", "length", "tool_calls"):
        out.append(f"finish_reason {finish!r}")
    seen = set()
    for call in calls:
        fn = call.get("function") or {}
        name, args = fn.get("name"), fn.get("arguments")
        if not call.get("id"):
            out.append(f"call without an id: {call}")
        if name not in tools:
            out.append(f"call of {name!r}, not an offered tool")
            continue
        if forced not in (None, "required") and name != forced:
            out.append(f"call of {name!r} where tool_choice named {forced!r}")
        try:
            value = json.loads(args)
        except (TypeError, ValueError):
            out.append(f"arguments of {name} are not JSON: {args!r}")
            continue
        if not isinstance(value, dict):
            out.append(f"arguments of {name} are not an object: {args!r}")
        else:
            out += [f"arguments of {name}: {p}" for p in _invalid(value, tools[name].get("parameters") or {})]
        key = (name, json.dumps(value, sort_keys=True))
        if key in seen:
            out.append(f"call {name}({args}) repeated")
        seen.add(key)
    if calls and finish != "tool_calls":
        out.append(f"{len(calls)} tool call(s) parsed but finish_reason is {finish!r}, not 'tool_calls'")
    if forced and not calls and finish != "length":
        out.append(f"tool_choice {req.get('tool_choice')!r} forced a call; none came back (finish {finish!r})")
    if calls and req.get("parallel_tool_calls") is False and len(calls) > 1:
        out.append(f"parallel_tool_calls is false and {len(calls)} calls came back")
    if (calls or forced) and _markup(content):
        out.append(f"tool-call markup left in content: {content[:200]!r}")
    elif forced and content.strip():
        out.append(f"a forced call came back with content {content[:200]!r}")
    rf = req.get("response_format") or {}
    if rf.get("type") == "json_schema" and finish == "stop" and not calls:
        schema = (rf.get("json_schema") or {}).get("schema") or {}
        try:
            out += [f"content: {p}" for p in _invalid(json.loads(content), schema)]
        except ValueError:
            out.append(f"json_schema answer is not JSON: {content[:200]!r}")
    if rf.get("type") == "json_object" and finish == "stop" and not calls:
        try:
            if not isinstance(json.loads(content), dict):
                out.append(f"json_object answer is not an object: {content[:200]!r}")
        except ValueError:
            out.append(f"json_object answer is not JSON: {content[:200]!r}")
    return out


def _markup(content: str) -> bool:
    """Whether ``content`` holds a tool-call block or ends in the start of one."""
    tail = content.rstrip()
    return TOOL_MARKUP in content or any(tail.endswith(TOOL_MARKUP[:k]) for k in range(2, len(TOOL_MARKUP)))


def _invalid(value: Any, schema: dict) -> list[str]:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return [e.message[:200] for e in validator(schema, format_checker=validator.FORMAT_CHECKER).iter_errors(value)]
